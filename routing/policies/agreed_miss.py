"""Where a cache miss goes so that several routers put the same new prefix on one worker.

A new prefix (a system prompt no worker holds yet) often arrives as a burst: the first turns
of several users at once, through several routers. One router credits the prompt to the
worker it chose, so the next request of the burst follows it; another router hears of that
credit only at its next sync (routing.peers.fleet_sync), and until then sees a miss of its own and
sends the prompt to its own least loaded worker: two workers then prefill the same prefix.
bench/replicas/run.py measured it on ``prefix`` at a cold start: 26-27 misses with two replicas
for the 16 the workload's 16 groups need with one router.

So a miss is placed by a rule every router computes alike without talking: among the
workers within ``spread`` requests of the least loaded, the one that ranks first for the
prompt's key by rendezvous hashing (highest ``hash((key, worker id))``; Python hashes
tuples of ints the same in every process). The key is the chain hash of the chunk at which
a match would start to count (the policy's ``cache_threshold`` share of the prompt), so two
users of one long system prompt share it, while prompts that share only a short preamble do
not. Routers whose views of the loads differ by less than ``spread`` agree; a worker more
than ``spread`` above the least loaded is never chosen for a miss, so the rule costs the
fleet's balance at most that many requests.
"""

from __future__ import annotations

from collections.abc import Sequence


def agreed_position(loads: Sequence[int], ids: Sequence[int], key: int, spread: float) -> int:
    """The position (in `loads` and `ids`, one per worker) the rule above chooses."""
    ceiling = min(loads) + spread
    best, best_score = 0, None
    for position, (load, worker_id) in enumerate(zip(loads, ids, strict=True)):
        if load <= ceiling:
            score = hash((key, worker_id))
            if best_score is None or score > best_score:
                best, best_score = position, score
    return best
