"""Governance: keys, budgets and the fair queue under a noisy neighbour, with one router or
several.

Run: ``.venv/bin/python -m bench.governance --help``. Modules: run.
"""
