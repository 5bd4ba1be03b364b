"""``python -m bench.pd``: see :mod:`bench.pd.run`."""

from bench.pd.run import main

raise SystemExit(main())
