"""``python -m bench.routing``: see :mod:`bench.routing.run`."""

from bench.routing.run import main

raise SystemExit(main())
