"""Coding agents: long Claude Code sessions of agents with different weights saturating one pool,
through one router and two replicas, against the client oracle.

Run: ``.venv/bin/python -m bench.agents --help``. Modules: run (the command line and the runs),
workload (the agents' seeded sessions, cache sizing, per-session TTFT and shares), report
(medians, same-round ratios, targets); it builds on bench.routing's and bench.replicas'
libraries.
"""
