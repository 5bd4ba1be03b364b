"""least_kv: the lowest fresh KV cache usage, in-flight requests as a penalty and tie-breaker, and
the least loaded worker when no usage is fresh.

Distribution tests count choices over thousands of calls with seeded generators where the
policy has one, so they are deterministic."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from routing.fleet.snapshot import WorkerView
from routing.policies.least_kv import LeastKVPolicy
from routing.policies.load import load_of
from tests.support.policy_views import (
    NO_INFLIGHT,
    REQUEST,
    counts,
    worker,
)


def fresh(worker_id: int, kv: float | None, age: float | None = 1.0, **changes: Any) -> WorkerView:
    return worker(worker_id, kv_cache_usage=kv, metrics_age=age, **changes)


def test_least_kv_picks_lowest_usage() -> None:
    policy = LeastKVPolicy()
    workers = (fresh(1, 0.5), fresh(2, 0.2), fresh(3, 0.8))
    assert counts(policy, workers, 20) == {2: 20}
    assert policy.decisions == {"kv": 20}


def test_least_kv_breaks_ties_by_inflight() -> None:
    for config in ({}, {"inflight_weight": 0}):
        policy = LeastKVPolicy(config)
        workers = (fresh(1, 0.3), fresh(2, 0.3), fresh(3, 0.3))
        assert counts(policy, workers, 5, {1: 3, 2: 1, 3: 2}) == {2: 5}


def test_least_kv_inflight_penalty_spreads_a_burst() -> None:
    policy = LeastKVPolicy()  # 0.01 per request in flight
    workers = (fresh(1, 0.10), fresh(2, 0.13))
    inflight: Counter[int] = Counter()
    for _ in range(20):
        chosen = policy.select(workers, REQUEST, inflight).worker
        assert chosen is not None
        inflight[chosen.id] += 1  # as the router does before on_request_start
    # 0.10 + n1 * 0.01 vs 0.13 + n2 * 0.01: the second starts taking requests after 3.
    assert inflight[2] > 0
    assert abs((inflight[1] - inflight[2]) - 3) <= 1, inflight


def test_least_kv_ignores_stale_and_missing_metrics_while_any_is_fresh() -> None:
    policy = LeastKVPolicy()
    workers = (
        fresh(1, 0.0, age=16.0),  # stale: default max age is 15 s
        fresh(2, 0.0, age=None),  # never scraped
        fresh(3, None),  # no KV figure
        fresh(4, float("nan")),
        fresh(5, 0.9, age=15.0),  # exactly at the limit still counts
    )
    assert counts(policy, workers, 10) == {5: 10}
    assert (
        LeastKVPolicy({"max_metrics_age": 30}).select(workers, REQUEST, NO_INFLIGHT).worker
        is workers[0]
    )


@pytest.mark.parametrize("age", [None, 60.0])
def test_least_kv_falls_back_to_least_loaded_and_counts_it(age: float | None) -> None:
    policy = LeastKVPolicy()
    workers = (fresh(1, 0.1, age=age), fresh(2, None, age=age), fresh(3, 0.0, age=age))
    workers += (fresh(4, 0.0, age=age),)
    loads = {1: 4, 2: 2, 3: 2, 4: 2}  # a three-way tie
    # Never random: the same worker (the first of the tie) every time.
    assert counts(policy, workers, 200, loads) == {2: 200}
    assert policy.decisions == {"fallback": 200}
    assert counts(policy, workers, 1, {1: 4, 2: 3, 3: 3, 4: 2}) == {4: 1}


def test_least_kv_matches_brute_force() -> None:
    rng = random.Random(11)
    for _ in range(300):
        penalty = rng.choice([0.0, 0.01, 0.05])
        policy = LeastKVPolicy({"inflight_weight": penalty})
        workers = tuple(
            fresh(i, rng.choice([0.0, 0.1, 0.11, 0.2, 0.5, None]), age=rng.choice([1.0, 99.0]))
            for i in range(rng.randint(1, 40))
        )
        inflight = {w.id: rng.randint(0, 6) for w in workers if rng.random() < 0.7}
        chosen = policy.select(workers, REQUEST, inflight).worker
        candidates = sorted(
            (w for w in workers if w.kv_cache_usage is not None and w.metrics_age == 1.0),
            key=lambda w: w.kv_cache_usage or 0.0,
        )
        if not candidates:
            assert chosen is min(workers, key=lambda w: load_of(w, inflight))
            continue

        def score(
            w: WorkerView, inflight: Mapping[int, int] = inflight, penalty: float = penalty
        ) -> tuple[float, int]:
            count = inflight.get(w.id, 0)
            return ((w.kv_cache_usage or 0.0) + count * penalty, count)

        assert chosen is min(candidates, key=score)
