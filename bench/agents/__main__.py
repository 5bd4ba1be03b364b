"""``python -m bench.agents``: see :mod:`bench.agents.run`."""

from bench.agents.run import main

raise SystemExit(main())
