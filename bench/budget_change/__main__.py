"""``python -m bench.budget_change``: see :mod:`bench.budget_change.run`."""

from bench.budget_change.run import main

raise SystemExit(main())
