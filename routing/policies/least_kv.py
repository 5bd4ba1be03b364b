"""Least KV cache: the worker whose scraped KV-cache usage is lowest, plus a load penalty.

vLLM preempts (and recomputes) requests when its KV cache fills, so KV-cache usage is a
better measure of a worker's headroom than request counts when prompts differ a lot in
length. The score of a worker is

    kv_cache_usage + load * inflight_weight

(load: routing.policies.load's fused signal, the same in every router) and the lowest score
wins; on equal scores the less loaded worker wins, then the earlier one. The scraped usage
only changes when a probe reads the worker's /metrics again (every few seconds), so without
the penalty every request of a burst would go to the one worker that looked emptiest at the
last scrape; the penalty makes each request any router sends there count, and the burst
spreads.

Only workers with fresh metrics are candidates: `metrics_age` (the age of the probe reading
when the snapshot was built) known and <= `max_metrics_age`, and `kv_cache_usage` known. A
worker whose metrics are missing or stale is passed over while any fresh one exists (so a
newly added worker gets traffic from its first scrape on). When no candidate has fresh
metrics the policy does not guess: it takes the least loaded worker (on a tie the earlier in
the list, never at random) and counts the decision as "fallback", so /metrics shows how
often least_kv had nothing to go on.

Decisions counted: "kv" (chosen on fresh metrics), "fallback" (no fresh metrics anywhere).

Config knobs:

* `max_metrics_age` (seconds, > 0, default 15): how old a scrape may be and still count.
* `inflight_weight` (>= 0, default 0.01): the penalty per unit of load (a request in
  flight), in units of KV-cache fraction; 0.01 means 10 requests weigh as much as 10 % of
  the cache. 0 makes the load a pure tie-breaker.

Cost: the fresh workers are ordered by usage once per snapshot; a decision scans them in that
order and stops once a worker's usage alone exceeds the best score found (the penalty can only
add to it), so it usually looks at a handful of workers even in a fleet of a thousand. The
fallback scans the workers and stops at an idle one (routing.policies.load.least_loaded):
quick on an idle fleet, but a pass over every worker once they all have work; so from 128
workers on it asks
a `LoadIndex` instead (O(log n); the same answer while only this policy's requests change its
workers' in-flight counts, see routing.policies.load_index).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import NO_WORKER, BasePolicy, Candidate, Choice, Explanation, RequestInfo
from routing.policies.load import check_keys, least_loaded, number
from routing.policies.load_index import LoadIndex


class LeastKVPolicy(BasePolicy):
    name = "least_kv"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        check_keys(self.name, self.config, ("max_metrics_age", "inflight_weight"))
        self.max_metrics_age = number(
            self.name, self.config, "max_metrics_age", 15.0, minimum=0.0, exclusive=True
        )
        self.inflight_weight = number(self.name, self.config, "inflight_weight", 0.01, minimum=0.0)
        self._workers: Sequence[WorkerView] | None = None
        self._size = 0
        self._fresh: tuple[tuple[float, WorkerView], ...] = ()
        self._loads = LoadIndex()  # for the fallback, from 128 workers

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Choice:
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        if not self._fresh:
            if not workers:
                return Choice(None, NO_WORKER)
            self.decisions["fallback"] += 1
            if self._loads.use(workers, loads):
                return Choice(workers[self._loads.least(loads)], "fallback")
            return Choice(least_loaded(workers, loads), "fallback")
        self.decisions["kv"] += 1
        return Choice(self._lowest_score(loads), "kv")

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        self._loads.touch(worker.id)

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        self._loads.touch(worker.id)

    def _lowest_score(self, loads: Mapping[int, int]) -> WorkerView:
        """Scan the fresh workers by ascending usage. A later worker scores at least its
        usage, so once that exceeds the best score (or equals it while the best has nothing
        in flight, which no tie-break can beat) nothing later can win."""
        penalty = self.inflight_weight
        best_kv, best = self._fresh[0]
        best_inflight = loads.get(best.id, 0)
        best_score = best_kv + best_inflight * penalty
        for kv, worker in self._fresh:
            if kv > best_score or (kv == best_score and best_inflight == 0):
                break
            count = loads.get(worker.id, 0)
            score = kv + count * penalty
            if score < best_score or (score == best_score and count < best_inflight):
                best, best_score, best_inflight = worker, score, count
        return best

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """Each worker's fresh KV usage (None: not fresh) and score, lowest first."""
        rows: list[tuple[float, int, WorkerView, Candidate]] = []
        for worker in workers:
            usage, load = self._fresh_usage(worker), loads.get(worker.id, 0)
            score = None if usage is None else round(usage + load * self.inflight_weight, 4)
            row = {"worker": worker.name, "kv_cache_usage": usage, "score": score, "load": load}
            rows.append((math.inf if score is None else score, load, worker, row))
        rows.sort(key=lambda r: (r[0], r[1]))
        fresh = bool(rows) and rows[0][0] != math.inf
        decision = "kv" if fresh else "fallback"
        chosen = rows[0][2] if fresh else least_loaded(workers, loads)
        return Explanation(decision, chosen, [r[3] for r in rows])

    def _index(self, workers: Sequence[WorkerView]) -> None:
        """Once per snapshot: the fresh workers by usage."""
        self._workers, self._size = workers, len(workers)
        fresh = [(u, w) for w in workers if (u := self._fresh_usage(w)) is not None]
        fresh.sort(key=lambda pair: pair[0])
        self._fresh = tuple(fresh)

    def _fresh_usage(self, worker: WorkerView) -> float | None:
        """The worker's KV-cache usage if it was scraped recently enough, else None."""
        age, usage = worker.metrics_age, worker.kv_cache_usage
        if age is None or age > self.max_metrics_age or usage is None or math.isnan(usage):
            return None
        return float(usage)
