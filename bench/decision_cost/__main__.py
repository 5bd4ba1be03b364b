"""``python -m bench.decision_cost``: see :mod:`bench.decision_cost.run`."""

from bench.decision_cost.run import main

raise SystemExit(main())
