"""``python -m bench.memory``: the router process's memory (VmRSS, VmHWM) and what it has
imported, at start-up, after the admin API's first requests and under /v1 traffic."""
