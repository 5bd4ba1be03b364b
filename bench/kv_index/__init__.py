"""The KV block index: what applying vLLM's KV event batches and looking up a prompt's blocks cost,
and the index's memory, in-process.

Run: ``.venv/bin/python -m bench.kv_index --help``. Modules: run.
"""
