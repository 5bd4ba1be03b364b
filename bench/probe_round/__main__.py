"""``python -m bench.probe_round``: see :mod:`bench.probe_round.run`."""

from bench.probe_round.run import main

raise SystemExit(main())
