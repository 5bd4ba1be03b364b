"""Unit tests of the balancing policies: pure functions of WorkerViews, no database, no network.

Distribution tests count choices over thousands of calls (as SGLang's power-of-two test does)
with seeded generators where the policy has one, so they are deterministic.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from hashlib import shake_128
from pathlib import Path
from typing import Any

import pytest

from routing.load_signal import LoadBoard
from routing.policies import POLICIES, make_policy, policy_class
from routing.policies.base import BasePolicy, RequestInfo
from routing.policies.least_kv import LeastKVPolicy
from routing.policies.load import least_loaded, load_of
from routing.policies.load_index import REBUILD_EVERY, LoadIndex
from routing.policies.power_of_two import PowerOfTwoPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.policies.session_affinity import SessionAffinityPolicy
from routing.policies.shortest_queue import ShortestQueuePolicy
from routing.policies.weighted_random import WeightedRandomPolicy
from routing.sessions import SessionReader, key_of
from routing.snapshot import WorkerView
from tests.factories import worker_view

ROOT = Path(__file__).resolve().parent.parent
NO_INFLIGHT: Mapping[int, int] = {}
REQUEST = RequestInfo(model="m", body={}, raw_headers=(), text="hello")


def worker(worker_id: int, **changes: Any) -> WorkerView:
    return worker_view(worker_id, **changes)


def fleet(n: int, **changes: Any) -> tuple[WorkerView, ...]:
    return tuple(worker(i, **changes) for i in range(1, n + 1))


def counts(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    calls: int,
    inflight: Mapping[int, int] = NO_INFLIGHT,
    request: RequestInfo = REQUEST,
) -> Counter[int]:
    picked: Counter[int] = Counter()
    for _ in range(calls):
        chosen = policy.select(workers, request, inflight)
        assert chosen is not None
        picked[chosen.id] += 1
    return picked


def pick(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    request: RequestInfo,
    inflight: Mapping[int, int],
) -> WorkerView:
    chosen = policy.select(workers, request, inflight)
    assert chosen is not None
    return chosen


def session(
    key: str | None = None, user: str | None = None, header: bytes = b"x-session-id"
) -> RequestInfo:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((header, key.encode("latin-1")))
    body: dict[str, Any] = {"model": "m", "messages": []}
    if user is not None:
        body["user"] = user
    # The session key as the router reads it once per request (routing.sessions).
    found = SessionReader().read(headers, body)
    return RequestInfo(model="m", body=body, raw_headers=headers, session=key_of(found))


# --- the registry ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_policy_builds_with_default_config_and_selects(name: str) -> None:
    policy = make_policy(name)
    assert type(policy) is policy_class(name)
    assert policy.name == name
    workers = fleet(3)
    assert policy.select(workers, REQUEST, NO_INFLIGHT) in workers
    assert policy.select((), REQUEST, NO_INFLIGHT) is None


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("round_robin", RoundRobinPolicy),
        ("random", WeightedRandomPolicy),
        ("power_of_two", PowerOfTwoPolicy),
        ("least_kv", LeastKVPolicy),
        ("session_affinity", SessionAffinityPolicy),
    ],
)
def test_policies_are_registered_by_name(name: str, cls: type[BasePolicy]) -> None:
    assert policy_class(name) is cls
    assert not cls.needs_request_text


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("round_robin", {"start": 1}),
        ("random", {"weights": [1, 2]}),
        ("power_of_two", {"choices": 3}),
        ("least_kv", {"max_metric_age": 15}),  # misspelt
        ("least_kv", {"max_metrics_age": 0}),
        ("least_kv", {"max_metrics_age": -1}),
        ("least_kv", {"max_metrics_age": "15"}),
        ("least_kv", {"max_metrics_age": True}),
        ("least_kv", {"max_metrics_age": float("nan")}),
        ("least_kv", {"max_metrics_age": float("inf")}),
        ("least_kv", {"inflight_weight": -0.01}),
        ("least_kv", {"inflight_weight": None}),
        ("session_affinity", {"header": ""}),
        ("session_affinity", {"header": " X-Session-ID"}),
        ("session_affinity", {"header": 7}),
        ("session_affinity", {"header": "X-Sitzung-€"}),
        ("session_affinity", {"max_load": -1}),
        ("session_affinity", {"max_load": 1.5}),
        ("session_affinity", {"max_load": "32"}),
        ("session_affinity", {"max_load": False}),
        ("session_affinity", {"cache_size": -5}),
        ("session_affinity", {"sticky": True}),
    ],
)
def test_bad_config_raises_value_error(name: str, config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=name):
        policy_class(name)(config)


def test_good_config_is_read() -> None:
    kv = LeastKVPolicy({"max_metrics_age": 30, "inflight_weight": 0})
    assert (kv.max_metrics_age, kv.inflight_weight) == (30.0, 0.0)
    affinity = SessionAffinityPolicy({"header": "X-Conv", "max_load": 4.0, "cache_size": 0})
    assert (affinity.header, affinity.max_load, affinity.cache_size) == (b"x-conv", 4, 0)
    assert SessionAffinityPolicy().header is None  # the router's session key only


# --- shared load helpers ------------------------------------------------------------------


def test_least_loaded_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        workers = fleet(rng.randint(1, 30))
        loads = {w.id: rng.choice([0, 1, 2, 5]) + rng.randint(0, 4) for w in workers}
        loads = {k: v for k, v in loads.items() if v or rng.random() < 0.5}
        expected = min(workers, key=lambda w: load_of(w, loads))  # the first on a tie
        assert least_loaded(workers, loads) is expected
    assert least_loaded((), NO_INFLIGHT) is None


def test_a_reported_queue_counts_once_and_only_beyond_the_fleets_own_requests() -> None:
    """The fused load (routing.policies.load's rule, computed by routing.load_signal)."""
    own: defaultdict[int, int] = defaultdict(int)
    board = LoadBoard(own, report_max_age=10.0)
    board.refresh(100.0, [1, 2, 3])
    board.started(1)  # this router sends one request to worker 1 at t=100
    board.others = {1: 2, 3: 1}  # two more from other routers, one on worker 3
    board.refresh(100.5, [1, 2, 3])
    # Worker 1 reports 5 at t=101 (the 3 from routers + 2 from elsewhere); worker 2 reports 4
    # (no router's); worker 3 reports 1 (the other router's one request), then goes idle.
    board.add_reports({1: (5, 101.0), 2: (4, 101.0), 3: (1, 101.0)})
    board.refresh(101.5, [1, 2, 3])
    assert board.loads == {1: 5, 2: 4, 3: 1}
    board.others = {1: 2}  # worker 3's request ended: it is idle at once, report or not
    board.finished(1)  # and this router's own request on worker 1 ended
    board.refresh(102.0, [1, 2, 3])
    assert board.loads == {1: 4, 2: 4, 3: 0}
    assert board.loads.version > 0
    board.refresh(112.0, [1, 2, 3])  # reports stale: the routers' own counts only
    assert board.loads == {1: 2, 2: 0, 3: 0}


# --- the load index (big fleets) ----------------------------------------------------------

BIG = 300  # > INDEX_MIN_WORKERS: policies go through a LoadIndex


def loads_of(workers: Sequence[WorkerView], inflight: Mapping[int, int]) -> list[int]:
    return [load_of(w, inflight) for w in workers]


def router_traffic(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    steps: int,
    rng: random.Random,
    inflight: Counter[int],
    check: Any,
) -> None:
    """Decisions as the router makes them: +1 before on_request_start, -1 before
    on_request_complete (a random request in flight completes now and then). `check(chosen,
    loads before)` runs after every decision."""
    running: list[WorkerView] = []
    for _ in range(steps):
        before = loads_of(workers, inflight)
        chosen = pick(policy, workers, REQUEST, inflight)
        check(chosen, before)
        inflight[chosen.id] += 1
        policy.on_request_start(chosen, REQUEST)
        running.append(chosen)
        while running and rng.random() < 0.45:
            done = running.pop(rng.randrange(len(running)))
            inflight[done.id] -= 1
            policy.on_request_complete(done, REQUEST, True)


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


# --- round robin --------------------------------------------------------------------------


def test_round_robin_even_counts_in_id_order() -> None:
    policy = RoundRobinPolicy()
    workers = (worker(3), worker(1), worker(2))
    picks = [policy.select(workers, REQUEST, NO_INFLIGHT) for _ in range(300)]
    assert [w.id for w in picks if w][:6] == [1, 2, 3, 1, 2, 3]
    assert Counter(w.id for w in picks if w) == {1: 100, 2: 100, 3: 100}


def test_round_robin_ignores_load() -> None:
    policy = RoundRobinPolicy()
    workers = (worker(1, queue_length=100), worker(2))
    assert counts(policy, workers, 10, {1: 50}) == {1: 5, 2: 5}


def test_round_robin_is_stable_when_workers_change() -> None:
    policy = RoundRobinPolicy()
    one, two, three, four = worker(1), worker(2), worker(3), worker(4)

    def ids(workers: Sequence[WorkerView], calls: int) -> list[int]:
        return [
            w.id for w in (policy.select(workers, REQUEST, NO_INFLIGHT) for _ in range(calls)) if w
        ]

    assert ids((one, two, three), 2) == [1, 2]
    assert ids([one, two, three, four], 3) == [3, 4, 1]  # a joiner slots in by id
    assert ids((one, three, four), 3) == [3, 4, 1]  # 2 left: skipped, nobody picked twice
    assert ids((four,), 2) == [4, 4]
    assert ids((one, two), 3) == [1, 2, 1]  # the last id (4) is gone: wrap around
    assert policy.select((), REQUEST, NO_INFLIGHT) is None


# --- weighted random ----------------------------------------------------------------------


def test_random_follows_weights() -> None:
    policy = WeightedRandomPolicy()
    policy.rng.seed(1)
    workers = (worker(1, weight=1.0), worker(2, weight=2.0), worker(3, weight=3.0))
    picked = counts(policy, workers, 60_000)
    for worker_id, share in ((1, 1 / 6), (2, 2 / 6), (3, 3 / 6)):
        assert abs(picked[worker_id] / 60_000 - share) < 0.01, picked


def test_random_never_picks_non_positive_weights() -> None:
    policy = WeightedRandomPolicy()
    workers = (worker(1, weight=0.0), worker(2, weight=-1.0), worker(3, weight=0.5))
    assert counts(policy, workers, 500) == {3: 500}


def test_random_is_uniform_when_no_weight_is_positive() -> None:
    policy = WeightedRandomPolicy()
    policy.rng.seed(2)
    picked = counts(policy, fleet(3, weight=0.0), 30_000)
    assert set(picked) == {1, 2, 3}
    assert all(abs(n / 30_000 - 1 / 3) < 0.02 for n in picked.values()), picked


def test_random_reindexes_a_new_worker_list() -> None:
    policy = WeightedRandomPolicy()
    assert counts(policy, (worker(1), worker(2, weight=0.0)), 50) == {1: 50}
    assert counts(policy, (worker(1, weight=0.0), worker(2)), 50) == {2: 50}


# --- power of two -------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["inflight", "queue_length"])
def test_power_of_two_prefers_less_loaded(via: str) -> None:
    policy = PowerOfTwoPolicy()
    policy.rng.seed(3)
    loads = {1: 10, 2: 5, 3: 0}
    workers = fleet(3)
    inflight: Mapping[int, int] = loads
    if via == "queue_length":  # reported by the workers, fused by the router's LoadBoard
        board = LoadBoard(defaultdict(int))
        board.add_reports({i: (n, 100.0) for i, n in loads.items()})
        board.refresh(100.0, loads)
        inflight = board.loads
    picked = counts(policy, workers, 3000, inflight)
    # Each of the three pairs is drawn ~1/3 of the time: the idle worker wins two pairs, the
    # middle one one pair, the busiest none.
    assert picked[3] > picked[2] > picked[1]
    assert picked[1] == 0
    assert 1800 < picked[3] < 2200, picked


def test_power_of_two_draws_two_distinct_workers() -> None:
    policy = PowerOfTwoPolicy()
    # With two workers, distinct candidates means both, every time: the busy one never wins.
    assert counts(policy, fleet(2), 500, {1: 1}) == {2: 500}


def test_power_of_two_tie_goes_either_way() -> None:
    policy = PowerOfTwoPolicy()
    policy.rng.seed(4)
    picked = counts(policy, fleet(2), 2000)
    assert 800 < picked[1] < 1200, picked


def test_power_of_two_single_worker() -> None:
    only = worker(9, queue_length=1000)
    assert PowerOfTwoPolicy().select((only,), REQUEST, NO_INFLIGHT) is only


# --- least KV -----------------------------------------------------------------------------


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
        chosen = policy.select(workers, REQUEST, inflight)
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
        LeastKVPolicy({"max_metrics_age": 30}).select(workers, REQUEST, NO_INFLIGHT) is workers[0]
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
        chosen = policy.select(workers, REQUEST, inflight)
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


# --- session affinity ---------------------------------------------------------------------


def placement(
    policy: SessionAffinityPolicy, workers: Sequence[WorkerView], keys: Sequence[str]
) -> dict[str, int]:
    result = {}
    for key in keys:
        chosen = policy.select(workers, session(key), NO_INFLIGHT)
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
        chosen = policy.select(workers, session(key), NO_INFLIGHT)
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
    by_header = policy.select(workers, session("alpha"), NO_INFLIGHT)
    by_user = policy.select(workers, session(user="alpha"), NO_INFLIGHT)
    both = policy.select(workers, session("alpha", user="omega"), NO_INFLIGHT)
    omega = policy.select(workers, session(user="omega"), NO_INFLIGHT)
    assert by_header is by_user is both
    assert omega is not both  # (these two keys land on different workers of 20)
    assert policy.decisions == {"affinity": 4}


def test_session_affinity_header_is_configurable_and_case_insensitive() -> None:
    workers = fleet(20)
    reference = SessionAffinityPolicy().select(workers, session("k1"), NO_INFLIGHT)
    for name in ("x-session-id", "X-SESSION-ID"):
        policy = SessionAffinityPolicy({"header": name})
        assert policy.select(workers, session("k1"), NO_INFLIGHT) is reference
    custom = SessionAffinityPolicy({"header": "X-Conversation"})
    assert custom.select(workers, session("k1", header=b"x-conversation"), NO_INFLIGHT) is reference
    # Without its own header, the router's session key (here X-Session-ID's) still counts.
    assert custom.select(workers, session("k1"), NO_INFLIGHT) is reference
    assert custom.select(workers, session(), {1: 3}) is not None
    assert custom.decisions == {"affinity": 2, "no_key": 1}


def test_session_affinity_without_key_takes_least_loaded() -> None:
    policy = SessionAffinityPolicy()
    workers = fleet(3)
    for request in (session(), session(""), session(user=""), session(user=None)):
        assert policy.select(workers, request, {1: 3, 2: 2, 3: 1}) is workers[2]
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
            a = cached.select(workers, session(key), inflight)
            b = uncached.select(workers, session(key), inflight)
            assert a is b
            assert a in workers  # the current snapshot's view, not a cached old one
    assert len(cached._cache) <= 50
    assert cached.decisions == uncached.decisions
    assert cached.decisions["overflow"] > 100


def test_session_affinity_keeps_cache_across_snapshots_with_same_ids() -> None:
    policy = SessionAffinityPolicy({"max_load": 3})
    workers = fleet(5)
    top = policy.select(workers, session("k"), NO_INFLIGHT)
    assert top is not None
    refreshed = tuple(replace(w, queue_length=4) if w.id == top.id else w for w in workers)
    moved = policy.select(refreshed, session("k"), {top.id: 4})
    assert moved is not None and moved.id != top.id  # new load figures are used
    assert "k" in policy._cache
    very_long = "x" * 1000
    assert (
        policy.select(workers, session(very_long), NO_INFLIGHT)
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
            a = policy.select(subset, session(key), inflight)
            assert a is uncached.select(subset, session(key), inflight) and a in subset
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
from routing.snapshot import ModelEntry, WorkerView
from tests.factories import worker_view
base = WorkerView(id=0, name="w", url="u", state="healthy", source="static",
                  models=(ModelEntry("m"),), queue_length=0, last_heartbeat=None, routable=True)
workers = tuple(replace(base, id=i) for i in json.loads(sys.argv[1]))
policy = SessionAffinityPolicy()
out = {}
for key in json.loads(sys.argv[2]):
    request = RequestInfo(model="m", body={"user": key}, raw_headers=(), session=key)
    out[key] = policy.select(workers, request, {}).id
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
