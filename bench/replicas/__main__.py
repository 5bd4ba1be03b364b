"""``python -m bench.replicas``: see :mod:`bench.replicas.run`."""

from bench.replicas.run import main

raise SystemExit(main())
