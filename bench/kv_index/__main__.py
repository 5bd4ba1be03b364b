"""``python -m bench.kv_index``: see :mod:`bench.kv_index.run`."""

from bench.kv_index.run import main

raise SystemExit(main())
