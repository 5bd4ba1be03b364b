"""Who may send a request now, and which waits: the steps before a request is forwarded.

Owns: client keys checked and rate limited (auth), token budgets per key (budgets), token
usage read from answers (usage), in-flight limits per worker and model with a bounded
wait (admission), and the waiting room ordered by priority class, then fairly between
keys and their sessions (fair_queue).

May import: routing.peers (shared rate limits and leases), routing.fleet (keys, priority
classes, WorkerViews), routing's bottom modules, the standard library, orjson and redis.
"""
