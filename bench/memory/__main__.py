"""``python -m bench.memory``: see :mod:`bench.memory.run`."""

from bench.memory.run import main

raise SystemExit(main())
