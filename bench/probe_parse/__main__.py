"""``python -m bench.probe_parse``: see :mod:`bench.probe_parse.run`."""

from bench.probe_parse.run import main

raise SystemExit(main())
