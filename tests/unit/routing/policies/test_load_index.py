"""routing.policies.load_index: the lazy heap of loads that big fleets (from INDEX_MIN_WORKERS on)
decide through, here through the policies that use it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy
from routing.policies.least_kv import LeastKVPolicy
from routing.policies.load import least_loaded
from routing.policies.load_index import REBUILD_EVERY, LoadIndex
from routing.policies.session_affinity import SessionAffinityPolicy
from routing.policies.shortest_queue import ShortestQueuePolicy
from tests.support.policy_views import (
    BIG,
    REQUEST,
    counts,
    fleet,
    pick,
    router_traffic,
)


def test_index_is_built_for_a_tuple_seen_twice_in_a_row() -> None:
    index = LoadIndex(random.Random(1))
    workers, inflight = fleet(BIG), {1: 2}
    assert not index.use(list(workers), inflight)  # a list: always scanned
    assert not index.use(fleet(10), inflight)  # a small fleet: scanned
    assert not index.use(workers, inflight)  # first time: scanned
    assert index.use(workers, inflight) and index.builds == 1
    for _ in range(5):  # one-off tuples in between (retries, subsets) are scanned...
        assert not index.use(workers[1:], inflight)
        assert index.use(workers, inflight)  # ...and leave the index alone
    assert index.builds == 1
    assert index.use(workers, {1: 2}) and index.builds == 2  # another mapping: rebuilt
    assert workers[index.least(inflight)].id != 1


def test_index_notices_unseen_changes_in_time() -> None:
    """A change no hook reports (another model's requests on a shared worker): a fall is
    seen within REBUILD_EVERY decisions, a rise at once."""
    policy = ShortestQueuePolicy()
    policy.rng.seed(6)
    workers = fleet(BIG)
    inflight = {w.id: 5 for w in workers}
    pick(policy, workers, REQUEST, inflight)
    pick(policy, workers, REQUEST, inflight)  # indexed from here
    inflight[7] = 0  # fell, unseen: until then the others (at 5) are taken
    late = 0
    while pick(policy, workers, REQUEST, inflight).id != 7:
        late += 1
    assert late <= REBUILD_EVERY
    assert counts(policy, workers, 50, inflight) == {7: 50}  # now it is known
    inflight[7] = 6  # rose, unseen: checked before use, so never taken at 6
    picked = counts(policy, workers, 2 * REBUILD_EVERY, inflight)
    assert 7 not in picked and len(picked) > 100


@pytest.mark.parametrize("case", ["least_kv", "session_affinity"])
def test_deterministic_fallbacks_are_the_same_on_big_fleets(case: str) -> None:
    """least_kv's fallback and session_affinity's no-key path take the least loaded, the
    earlier on a tie: through the index the very same worker."""
    rng = random.Random(8)
    policy: BasePolicy = LeastKVPolicy() if case == "least_kv" else SessionAffinityPolicy()
    workers = fleet(BIG)
    inflight: Counter[int] = Counter(
        {w.id: rng.randint(0, 3) + rng.choice([0, 0, 1, 2]) for w in workers}
    )

    def check(chosen: WorkerView, before: list[int]) -> None:
        assert chosen is least_loaded(workers, inflight)

    router_traffic(policy, workers, 3000, rng, inflight, check)
    assert policy.decisions == {"fallback" if case == "least_kv" else "no_key": 3000}
