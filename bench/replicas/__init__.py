"""Replicas: several routers in front of the same four workers, on PostgreSQL and Redis, against
one router and the client oracle.

Run: ``.venv/bin/python -m bench.replicas --help``. Modules: run (the command line and the
rounds), setups (the set-ups: one router, serve --routers, replicas behind haproxy, the oracle),
measure (one measured run, CPU and Redis readings), report (medians, targets); it builds on
bench.routing's fleet, workloads, modes and load, and bench.overhead's load.
"""
