"""Router overhead: the same load direct to the workers, through a minimal reference proxy (the
floor) and through the router, in one interleaved run.

Run: ``.venv/bin/python -m bench.overhead --help``. Modules: run (the command line, the fleet,
the rounds), load (scenarios, modes, the load generator, CPU counters), stats (per-round
figures, medians), report (the markdown, targets).
"""
