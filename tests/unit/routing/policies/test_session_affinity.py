"""session_affinity: a session's key on a hash ring of the workers, so the same key goes to the
same worker in every process, moving only what a fleet change must move.

Distribution tests count choices over thousands of calls with seeded generators where the
policy has one, so they are deterministic."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import replace
from hashlib import shake_128

from routing.fleet.load_signal import LoadBoard
from routing.fleet.snapshot import WorkerView
from routing.policies.session_affinity import SessionAffinityPolicy
from tests.support.common import ROOT
from tests.support.policy_views import (
    BIG,
    NO_INFLIGHT,
    fleet,
    pick,
    session,
    worker,
)


def placement(
    policy: SessionAffinityPolicy, workers: Sequence[WorkerView], keys: Sequence[str]
) -> dict[str, int]:
    result = {}
    for key in keys:
        chosen = policy.select(workers, session(key), NO_INFLIGHT).worker
        assert chosen is not None
        result[key] = chosen.id
    return result


KEYS = [f"session-{i}" for i in range(1000)]


def test_session_affinity_same_key_same_worker() -> None:
    workers = fleet(8)
    first = placement(SessionAffinityPolicy(), workers, KEYS)
    policy = SessionAffinityPolicy()
    for _ in range(3):
        assert placement(policy, workers, KEYS) == first
    assert placement(SessionAffinityPolicy({"cache_size": 0}), workers[::-1], KEYS) == first
    assert policy.decisions == {"affinity": 3000}
    # Sessions spread over the fleet: 125 each on average.
    assert all(80 < n < 170 for n in Counter(first.values()).values()), Counter(first.values())


def documented_score(key: str, worker_id: int) -> int:
    """session_affinity's score, from its docstring: the shortest clockwise distance on a
    2**64 ring from any of the key's 8 probes to any of the worker's 32 points."""

    def words(data: bytes, n: int) -> list[int]:
        raw = shake_128(data).digest(8 * n)
        return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, 8 * n, 8)]

    probes, points = words(b"key:" + key.encode(), 8), words(b"worker:%d" % worker_id, 32)
    return min((point - probe) % 2**64 for probe in probes for point in points)


def test_session_affinity_uses_the_documented_hash() -> None:
    """A change of formula would move every session at upgrade, so it is pinned here."""
    ids = [3, 17, 42, 99, 1000]
    workers = tuple(worker(i) for i in ids)
    policy = SessionAffinityPolicy()
    for key in KEYS[:200]:
        expected = sorted(ids, key=lambda worker_id, key=key: documented_score(key, worker_id))
        assert [w.id for w in policy.ranking(workers, key)] == expected
        chosen = policy.select(workers, session(key), NO_INFLIGHT).worker
        assert chosen is not None and chosen.id == expected[0]


def test_session_affinity_removing_a_worker_moves_only_its_sessions() -> None:
    workers = fleet(10)
    policy = SessionAffinityPolicy()
    before = placement(policy, workers, KEYS)
    gone = 4
    after = placement(policy, tuple(w for w in workers if w.id != gone), KEYS)
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == gone}
    assert len({after[key] for key in moved}) >= 5  # they spread, not all to one neighbour
    assert placement(policy, workers, KEYS) == before  # and come back when it returns


def test_session_affinity_adding_a_worker_moves_about_one_in_n_plus_one() -> None:
    workers = fleet(10)
    policy = SessionAffinityPolicy()
    before = placement(policy, workers, KEYS)
    after = placement(policy, (*workers, worker(11)), KEYS)
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == 11 for key in moved)  # only to the newcomer
    assert 0.5 / 11 < len(moved) / len(KEYS) < 1.5 / 11, len(moved)


def test_session_affinity_header_wins_over_user() -> None:
    policy = SessionAffinityPolicy()
    workers = fleet(20)
    by_header = policy.select(workers, session("alpha"), NO_INFLIGHT).worker
    by_user = policy.select(workers, session(user="alpha"), NO_INFLIGHT).worker
    both = policy.select(workers, session("alpha", user="omega"), NO_INFLIGHT).worker
    omega = policy.select(workers, session(user="omega"), NO_INFLIGHT).worker
    assert by_header is by_user is both
    assert omega is not both  # (these two keys land on different workers of 20)
    assert policy.decisions == {"affinity": 4}


def test_session_affinity_header_is_configurable_and_case_insensitive() -> None:
    workers = fleet(20)
    reference = SessionAffinityPolicy().select(workers, session("k1"), NO_INFLIGHT).worker
    for name in ("x-session-id", "X-SESSION-ID"):
        policy = SessionAffinityPolicy({"header": name})
        assert policy.select(workers, session("k1"), NO_INFLIGHT).worker is reference
    custom = SessionAffinityPolicy({"header": "X-Conversation"})
    assert (
        custom.select(workers, session("k1", header=b"x-conversation"), NO_INFLIGHT).worker
        is reference
    )
    # Without its own header, the router's session key (here X-Session-ID's) still counts.
    assert custom.select(workers, session("k1"), NO_INFLIGHT).worker is reference
    assert custom.select(workers, session(), {1: 3}).worker is not None
    assert custom.decisions == {"affinity": 2, "no_key": 1}


def test_session_affinity_without_key_takes_least_loaded() -> None:
    policy = SessionAffinityPolicy()
    workers = fleet(3)
    for request in (session(), session(""), session(user=""), session(user=None)):
        assert policy.select(workers, request, {1: 3, 2: 2, 3: 1}).worker is workers[2]
    assert policy.decisions == {"no_key": 4}


def test_session_affinity_overload_moves_to_next_in_order() -> None:
    policy = SessionAffinityPolicy({"max_load": 5})
    workers = fleet(6)
    order = policy.ranking(workers, "user-42")
    first, second, third = order[0].id, order[1].id, order[2].id
    assert pick(policy, workers, session("user-42"), {first: 5}).id == first  # at max: stays
    assert pick(policy, workers, session("user-42"), {first: 6}).id == second
    assert pick(policy, workers, session("user-42"), {first: 6, second: 9}).id == third
    assert policy.decisions == {"affinity": 1, "overflow": 2}
    # A reported queue counts too, through the router's fused loads.
    board = LoadBoard(defaultdict(int))
    board.add_reports({first: (6, 100.0)})
    board.refresh(100.0, [w.id for w in workers])
    assert pick(policy, workers, session("user-42"), board.loads).id == second


def test_session_affinity_overload_past_the_cached_leaders() -> None:
    policy = SessionAffinityPolicy({"max_load": 0})
    workers = fleet(8)
    order = [w.id for w in policy.ranking(workers, "k")]
    busy = {worker_id: 1 for worker_id in order[:5]}  # more than the 4 cached leaders
    assert pick(policy, workers, session("k"), busy).id == order[5]
    assert policy.decisions == {"overflow": 1}


def test_session_affinity_all_overloaded_takes_least_loaded() -> None:
    policy = SessionAffinityPolicy({"max_load": 2})
    workers = fleet(4)
    order = [w.id for w in policy.ranking(workers, "k")]
    inflight = {order[0]: 9, order[1]: 4, order[2]: 3, order[3]: 3}
    assert pick(policy, workers, session("k"), inflight).id == order[2]  # tie: higher-ranked
    inflight[order[0]] = 3
    assert pick(policy, workers, session("k"), inflight).id == order[0]
    assert policy.decisions == {"affinity": 1, "overflow": 1}


def test_session_affinity_cache_follows_the_fleet() -> None:
    """The cached answer must always equal a fresh computation, whatever the fleet does."""
    rng = random.Random(5)
    cached = SessionAffinityPolicy({"cache_size": 50, "max_load": 3})
    uncached = SessionAffinityPolicy({"cache_size": 0, "max_load": 3})
    ids = list(range(1, 13))
    keys = KEYS[:120]
    for _ in range(40):
        present = sorted(rng.sample(ids, rng.randint(1, len(ids))))
        workers = tuple(worker(i, weight=rng.choice([1.0, 2.0])) for i in present)
        queued = {i: rng.randint(0, 3) for i in present}
        for key in rng.sample(keys, 60):
            inflight = {i: rng.randint(0, 2) + queued[i] for i in present}  # some overloaded
            a = cached.select(workers, session(key), inflight).worker
            b = uncached.select(workers, session(key), inflight).worker
            assert a is b
            assert a in workers  # the current snapshot's view, not a cached old one
    assert len(cached._cache) <= 50
    assert cached.decisions == uncached.decisions
    assert cached.decisions["overflow"] > 100


def test_session_affinity_keeps_cache_across_snapshots_with_same_ids() -> None:
    policy = SessionAffinityPolicy({"max_load": 3})
    workers = fleet(5)
    top = policy.select(workers, session("k"), NO_INFLIGHT).worker
    assert top is not None
    refreshed = tuple(replace(w, queue_length=4) if w.id == top.id else w for w in workers)
    moved = policy.select(refreshed, session("k"), {top.id: 4}).worker
    assert moved is not None and moved.id != top.id  # new load figures are used
    assert "k" in policy._cache
    very_long = "x" * 1000
    assert (
        policy.select(workers, session(very_long), NO_INFLIGHT).worker
        is policy.ranking(workers, very_long)[0]
    )
    assert very_long not in policy._cache


def test_session_affinity_spreads_keys_evenly() -> None:
    """Each worker's share of the keys is 1/n give or take a few percent: the ring's
    unevenness (about 5 % of 1/n) plus the sampling noise of 1,000 keys a worker (3 %)."""
    for first_id in (1, 500):
        workers = tuple(worker(i) for i in range(first_id, first_id + 40))
        policy = SessionAffinityPolicy({"cache_size": 0})
        shares = Counter(placement(policy, workers, [f"k{i}" for i in range(40_000)]).values())
        ratios = [shares[w.id] / 1000 for w in workers]
        assert min(ratios) > 0.75 and max(ratios) < 1.25, ratios
        mean = sum(ratios) / len(ratios)
        assert (sum((r - mean) ** 2 for r in ratios) / len(ratios)) ** 0.5 < 0.09


def test_session_affinity_big_fleet_moves_only_what_it_must() -> None:
    workers = fleet(BIG)
    keys = [f"user-{i}" for i in range(15_000)]
    policy = SessionAffinityPolicy()
    before = placement(policy, workers, keys)
    gone = {5, 77, 150}
    after = placement(policy, tuple(w for w in workers if w.id not in gone), keys)
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] in gone}
    # They spread: ~158 keys drawn over 297 workers at random would land on ~122 of them.
    assert len({after[key] for key in moved}) > 100
    joined = placement(policy, (*workers, worker(BIG + 1)), keys)
    taken = [key for key in keys if joined[key] != before[key]]
    assert all(joined[key] == BIG + 1 for key in taken)
    assert 0.6 / (BIG + 1) < len(taken) / len(keys) < 1.4 / (BIG + 1), len(taken)


def test_session_affinity_keeps_ring_and_cache_while_workers_only_leave() -> None:
    workers = fleet(BIG)
    policy = SessionAffinityPolicy({"max_load": 1})
    uncached = SessionAffinityPolicy({"cache_size": 0, "max_load": 1})
    placement(policy, workers, KEYS)
    placement(uncached, workers, KEYS)
    ring = policy._points
    for step in range(1, 6):  # a retry's list, ejections, drains: subsets of the ring's ids
        subset = tuple(w for w in workers if w.id % 7 != step)
        inflight = {w.id: w.id % 3 for w in workers}  # a third are over max_load
        for key in KEYS[:300]:
            a = policy.select(subset, session(key), inflight).worker
            assert a is uncached.select(subset, session(key), inflight).worker and a in subset
        assert policy._points is ring and len(policy._cache) == len(KEYS)
    assert policy.decisions == uncached.decisions and policy.decisions["overflow"] > 100
    placement(policy, workers[: BIG // 3 - 5], KEYS[:1])  # most ids gone: a smaller ring
    assert policy._points is not ring and len(policy._cache) == 1
    policy.select((*workers, worker(BIG + 1)), session("k"), NO_INFLIGHT)  # an id joins
    assert len(policy._ring_ids) == BIG + 1 and list(policy._cache) == ["k"]


STABILITY_SCRIPT = """
import json, sys
from dataclasses import replace
from routing.policies.session_affinity import SessionAffinityPolicy
from routing.policies.shortest_queue import ShortestQueuePolicy
from routing.policies.base import RequestInfo
from routing.fleet.snapshot import ModelEntry, WorkerView
from bench.common.workers import worker_view
base = WorkerView(id=0, name="w", url="u", state="healthy", source="static",
                  models=(ModelEntry("m"),), queue_length=0, last_heartbeat=None, routable=True)
workers = tuple(replace(base, id=i) for i in json.loads(sys.argv[1]))
policy = SessionAffinityPolicy()
out = {}
for key in json.loads(sys.argv[2]):
    request = RequestInfo(model="m", body={"user": key}, raw_headers=(), session=key)
    out[key] = policy.select(workers, request, {}).worker.id
print(json.dumps(out))
"""


def test_session_affinity_is_stable_across_processes() -> None:
    ids = [2, 5, 8, 13, 21, 34, 55, 89]
    keys = KEYS[:300]
    workers = tuple(worker(i) for i in ids)
    policy = SessionAffinityPolicy()
    here = {key: pick(policy, workers, session(user=key), NO_INFLIGHT).id for key in keys}
    for seed in ("0", "12345"):  # Python's own hash() would differ between these
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", STABILITY_SCRIPT, json.dumps(ids), json.dumps(keys)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=60,
            check=True,
        )
        assert json.loads(result.stdout) == here
