"""Shortest queue: the worker with the least work, ties broken at random.

A worker's load is routing.policies.load's: the requests every router has in flight on it,
plus what it reported beyond them while its report is fresh, so a worker kept busy by
another router or another client looks busy, and one that went idle looks idle at once.
Random tie-breaking spreads a burst over equally idle workers instead of
piling it on the first one in the list.

Cost: below 128 workers (routing.policies.load_index.INDEX_MIN_WORKERS) a decision scans
every worker: exact, ties by `random.choice`, a few µs. From 128 workers on, the second and
later decisions over the same snapshot tuple ask a `LoadIndex` (a lazy min-heap rebuilt per
snapshot and every 256 decisions), which costs O(log n): exact too as long as only this
policy's requests change the in-flight counts of its workers; see that module for how ties
are drawn and how a load changed by another model's requests on a shared worker is caught.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy, RequestInfo
from routing.policies.load_index import LoadIndex


class ShortestQueuePolicy(BasePolicy):
    name = "shortest_queue"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.rng = random.Random()
        self._index = LoadIndex(self.rng)

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        if self._index.use(workers, loads):
            return workers[self._index.least(loads)]
        best: list[WorkerView] = []
        best_load = 0
        for worker in workers:
            load = loads.get(worker.id, 0)
            if not best or load < best_load:
                best, best_load = [worker], load
            elif load == best_load:
                best.append(worker)
        if not best:
            return None
        return best[0] if len(best) == 1 else self.rng.choice(best)

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        self._index.touch(worker.id)

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        self._index.touch(worker.id)
