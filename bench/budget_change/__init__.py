"""Budget changes: how fast a changed key budget reaches every router.

Run: ``.venv/bin/python -m bench.budget_change --help``. Modules: run.
"""
