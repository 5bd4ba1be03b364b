"""``python -m bench.idle``: see :mod:`bench.idle.run`."""

from bench.idle.run import main

raise SystemExit(main())
