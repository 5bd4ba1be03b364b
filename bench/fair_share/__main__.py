"""``python -m bench.fair_share``: see :mod:`bench.fair_share.run`."""

from bench.fair_share.run import main

raise SystemExit(main())
