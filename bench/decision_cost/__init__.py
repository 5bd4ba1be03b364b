"""Decision cost: what one routing decision costs, every registered policy at 4, 100 and 1,000
workers, in-process.

Run: ``.venv/bin/python -m bench.decision_cost --help``. Modules: run.
"""
