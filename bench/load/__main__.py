"""``python -m bench.load``: see :mod:`bench.load.run`."""

from bench.load.run import main

raise SystemExit(main())
