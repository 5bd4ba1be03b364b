"""Routing policies: which policy keeps the workers' prefix caches warm without overloading one, on
seeded workloads from cold caches, against client-side baselines.

Run: ``.venv/bin/python -m bench.routing --help``. Modules: run (the command line and the runs),
fleet (workers, router, Celery, floor proxy; counters), workloads (seeded sessions, cache
sizing), modes (policies, their configs, switching; the baselines), load (the load generator,
one measured run), affinity (the session affinity phase and its drain), churn (the churn
workload, kv_aware's accuracy), report (the markdown, targets). The replicas and agents
benchmarks build on fleet, workloads, modes and load.
"""
