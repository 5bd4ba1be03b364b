"""kv_aware's decision cost on a 4,000-word prompt, its tokenization timed apart, in-process.

Run: ``.venv/bin/python -m bench.kv_aware_cost --help``. Modules: run.
"""
