"""shortest_queue: exactly the least loaded worker, ties at random, on a big fleet (through the
load index) as on a small one.

Distribution tests count choices over thousands of calls with seeded generators where the
policy has one, so they are deterministic."""

from __future__ import annotations

import random
from collections import Counter

from routing.fleet.snapshot import WorkerView
from routing.policies.load import load_of
from routing.policies.load_index import REBUILD_EVERY
from routing.policies.shortest_queue import ShortestQueuePolicy
from tests.support.policy_views import (
    BIG,
    REQUEST,
    counts,
    fleet,
    pick,
    router_traffic,
)


def test_shortest_queue_big_fleet_is_exactly_least_loaded() -> None:
    rng = random.Random(3)
    policy = ShortestQueuePolicy()
    policy.rng.seed(4)
    workers = fleet(BIG)
    inflight: Counter[int] = Counter({w.id: rng.choice([0, 1, 3]) for w in workers})

    def check(chosen: WorkerView, before: list[int]) -> None:
        assert load_of(chosen, inflight) == min(before)

    router_traffic(policy, workers, 4000, rng, inflight, check)
    assert policy._index.builds >= 4000 // REBUILD_EVERY
    # Superseded entries are dropped: the heap stays near one entry per worker.
    assert len(policy._index._heap) <= BIG + 2 * REBUILD_EVERY
    assert all(v >= 0 for v in inflight.values())


def test_shortest_queue_big_fleet_breaks_ties_at_random() -> None:
    policy = ShortestQueuePolicy()
    policy.rng.seed(5)
    workers = fleet(BIG)
    inflight: Counter[int] = Counter()
    first_round = []
    for _ in range(BIG):  # an idle fleet, nothing completes: each worker once, in some order
        chosen = pick(policy, workers, REQUEST, inflight)
        inflight[chosen.id] += 1
        policy.on_request_start(chosen, REQUEST)
        first_round.append(chosen.id)
    assert sorted(first_round) == [w.id for w in workers]
    assert first_round[:20] != sorted(first_round[:20])  # not in list order
    # Without the hooks (equal loads that never change), every worker still gets its turn.
    picked = counts(policy, workers, 30 * BIG, inflight)
    assert set(picked) == {w.id for w in workers}
    assert max(picked.values()) < 3 * 30, max(picked.values())
