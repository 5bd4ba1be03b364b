"""``python -m bench.metrics_size``: see :mod:`bench.metrics_size.run`."""

from bench.metrics_size.run import main

raise SystemExit(main())
