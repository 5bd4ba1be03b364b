"""The size and render time of the router's /metrics page with many workers' vLLM series,
in-process.

Run: ``.venv/bin/python -m bench.metrics_size --help``. Modules: run.
"""
