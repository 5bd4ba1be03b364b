"""``python -m bench.kv_aware_cost``: see :mod:`bench.kv_aware_cost.run`."""

from bench.kv_aware_cost.run import main

raise SystemExit(main())
