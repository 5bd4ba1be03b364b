"""``python -m bench.overhead``: see :mod:`bench.overhead.run`."""

from bench.overhead.run import main

raise SystemExit(main())
