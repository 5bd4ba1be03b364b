"""Fair share of a saturated pool: two keys of weights 3 and 1 with the same closed loops; the
weight-3 key's share should be 0.75.

Run: ``.venv/bin/python -m bench.fair_share --help``. Modules: run.
"""
