"""Shortest queue: the worker with the least work, ties broken at random.

A worker's load is the requests this router has in flight on it plus the queue length
the worker last reported (heartbeat or probe), so a worker kept busy by another router
still looks busy. Random tie-breaking spreads a burst over equally idle workers instead of
piling it on the first one in the list.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from routing.policies.base import BasePolicy, RequestInfo
from routing.snapshot import WorkerView


class ShortestQueuePolicy(BasePolicy):
    name = "shortest_queue"

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, inflight: Mapping[int, int]
    ) -> WorkerView | None:
        best: list[WorkerView] = []
        best_load = 0
        for worker in workers:
            load = inflight.get(worker.id, 0) + (worker.queue_length or 0)
            if not best or load < best_load:
                best, best_load = [worker], load
            elif load == best_load:
                best.append(worker)
        if not best:
            return None
        return best[0] if len(best) == 1 else random.choice(best)
