"""``python -m bench.governance``: see :mod:`bench.governance.run`."""

from bench.governance.run import main

raise SystemExit(main())
