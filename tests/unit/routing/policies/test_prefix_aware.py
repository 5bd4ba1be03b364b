"""The prefix_aware policy: where a prompt goes (prefix, miss or load), on small fleets and
through the load index on big ones, and its configuration. Pure unit tests (no DB, no I/O)."""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from routing.fleet.load_signal import LoadBoard
from routing.policies.base import RequestInfo
from routing.policies.prefix_aware import PrefixAwarePolicy
from tests.support.prefix_aware import Clock, ask, check_invariants, fleet, make, words

# -- routing -----------------------------------------------------------------------------------


def test_shared_long_prefix_goes_to_the_worker_that_saw_it() -> None:
    policy, workers = make(), fleet(4)
    system = words("sys", 400)
    first = ask(policy, workers, system + " question one")
    assert policy.decisions == {"miss": 1}
    for i in range(10):
        assert ask(policy, workers, f"{system} follow-up question {i}").id == first.id
    assert policy.decisions == {"miss": 1, "prefix": 10}


def test_the_next_turn_of_a_chat_sticks_to_its_worker() -> None:
    policy, workers = make(), fleet(3)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": words("q", 300)}],
    }
    homes = set()
    for turn in range(5):
        chosen = policy.select(workers, RequestInfo("m", body, ()), {}).worker  # text from the body
        assert chosen is not None
        homes.add(chosen.id)
        body["messages"] += [
            {"role": "assistant", "content": words(f"a{turn}-", 50)},
            {"role": "user", "content": words(f"u{turn}-", 50)},
        ]
    assert len(homes) == 1
    assert policy.decisions == {"miss": 1, "prefix": 4}


def test_different_prefixes_spread_over_the_smallest_trees() -> None:
    policy, workers = make(), fleet(3)
    chosen = [ask(policy, workers, words(tag, 300)).id for tag in ("a", "b", "c")]
    assert sorted(chosen) == [0, 1, 2]  # all idle: the smallest tree decides
    assert policy.decisions == {"miss": 3}
    # A fourth new prompt goes to the least loaded worker, whatever its tree; a prompt
    # matching less than cache_threshold is a miss too.
    busy = {chosen[0]: 5, chosen[1]: 1, chosen[2]: 3}
    assert ask(policy, workers, words("d", 300), busy).id == chosen[1]
    half = words("a", 100) + " " + words("x", 300)  # shares only ~1/4 with "a"
    ask(policy, workers, half)
    assert policy.decisions == {"miss": 5}


def test_among_equal_loads_a_miss_prefers_the_worker_that_remembers_least() -> None:
    policy, workers = make(), fleet(3)
    policy.insert(0, words("big", 600))
    policy.insert(1, words("small", 50))
    assert ask(policy, workers, words("new", 200)).id == 2  # an empty tree
    assert policy.tree_size(2) > policy.tree_size(1)
    assert ask(policy, workers, words("newer", 20)).id == 1


def test_prefix_ties_go_to_the_least_loaded_holder() -> None:
    policy, workers = make(), fleet(3)
    text = words("doc", 300)
    policy.insert(0, text)
    policy.insert(2, text)
    assert ask(policy, workers, text + " more A", {0: 4, 2: 1}).id == 2
    assert ask(policy, workers, text + " more B", {0: 1, 2: 4}).id == 0
    assert policy.decisions == {"prefix": 2}


def test_hot_prefix_moves_to_the_least_loaded_past_the_thresholds() -> None:
    policy, workers = make(), fleet(4)
    hot = words("hot", 300)
    inflight: dict[int, int] = {}
    picks = []
    for i in range(40):  # none completes: the loads only grow
        chosen = ask(policy, workers, f"{hot} request {i}", inflight)
        inflight[chosen.id] = inflight.get(chosen.id, 0) + 1
        picks.append(chosen.id)
    home = picks[0]
    # 1 miss, then the prefix wins until home is 33 ahead of the idle ones (> 32, > 1.1 x 0)...
    assert picks[:33] == [home] * 33
    # ...then one request goes by load, and the worker that took it holds the prefix too:
    # the rest go to the less loaded of the two holders, by prefix, never home.
    moved = picks[33]
    assert moved != home
    assert picks[33:] == [moved] * 7
    assert policy.decisions == {"miss": 1, "prefix": 32 + 6, "load": 1}
    # Once calm, the least loaded holder gets it.
    calm = {w.id: 5 for w in workers}
    calm[home] = 9
    assert ask(policy, workers, f"{hot} calm", calm).id == moved


def test_imbalance_needs_both_thresholds() -> None:
    policy, workers = make(), fleet(2)
    text = words("p", 300)
    policy.insert(0, text)
    # Exceeds the absolute threshold (35 > 32) but not the relative one (400 < 1.1 x 365).
    assert ask(policy, workers, text, {0: 400, 1: 365}).id == 0
    # Relative (40 > 1.1 x 10) but not absolute (30 <= 32).
    assert ask(policy, workers, text, {0: 40, 1: 10}).id == 0
    assert policy.decisions == {"prefix": 2}
    # Both: the least loaded.
    assert ask(policy, workers, text, {0: 40, 1: 5}).id == 1
    assert policy.decisions == {"prefix": 2, "load": 1}
    # A reported queue counts as load too, through the router's fused loads.
    queued = make()
    queued.insert(0, text)
    board = LoadBoard(defaultdict(int))
    board.add_reports({0: (40, 100.0)})
    board.refresh(100.0, [0, 1])
    assert ask(queued, workers, text, board.loads).id == 1
    assert queued.decisions == {"load": 1}
    # Thresholds are configurable.
    strict = make({"balance_abs_threshold": 2, "balance_rel_threshold": 1.5})
    strict.insert(0, text)
    assert ask(strict, workers, text, {0: 4, 1: 1}).id == 1
    assert strict.decisions == {"load": 1}


def test_only_requests_bound_for_the_overloaded_worker_move() -> None:
    policy, workers = make(), fleet(4)
    hot, cold = words("hot", 300), words("cold", 300)
    policy.insert(0, hot)
    policy.insert(1, cold)
    busy = {0: 40, 1: 2}  # worker 0 is overloaded; 2 and 3 are idle
    # SGLang's fleet-wide check would send the cold prompt away from its idle-enough home.
    assert ask(policy, workers, cold + " again", busy).id == 1
    assert ask(policy, workers, hot + " again", busy).id in {2, 3}
    assert policy.decisions == {"prefix": 1, "load": 1}


def test_a_miss_goes_to_the_least_loaded_then_the_smallest_tree() -> None:
    policy, workers = make(), fleet(4)
    for i, n in enumerate((400, 300, 100, 50)):
        policy.insert(i, words(f"old{i}-", n))
    assert ask(policy, workers, words("new", 300), {3: 1}).id == 2  # 3's tree is smaller
    assert ask(policy, workers, words("newer", 300)).id == 3  # 2's has grown past it
    assert ask(policy, workers, words("newest", 300), {0: 2, 1: 1, 2: 3, 3: 4}).id == 1
    assert policy.decisions == {"miss": 3}


def skewed_traffic(config: Mapping[str, Any]) -> tuple[Counter[int], Counter[int], float]:
    """A closed loop of 16 chat sessions at a time over 4 workers, half of the users on one
    hot system prompt, the rest on 15 other groups; every step one random request in flight
    completes and its session sends its next turn (or a new session starts). Returns the
    hot prompt's requests per worker, all requests per worker, and the share of the cold
    groups' requests that went to their group's usual worker."""
    rng = random.Random(7)
    policy = PrefixAwarePolicy(config, clock=Clock(), rng=random.Random(1))
    workers = fleet(4)
    systems = [words(f"sys{g}-", 250) for g in range(16)]
    inflight: Counter[int] = Counter()
    hot: Counter[int] = Counter()
    total: Counter[int] = Counter()
    cold_homes: dict[int, Counter[int]] = {}
    running: list[tuple[int, str, int]] = []  # (worker, history, group)

    def send(history: str, group: int) -> None:
        chosen = ask(policy, workers, history, inflight)
        inflight[chosen.id] += 1
        total[chosen.id] += 1
        if group == 0:
            hot[chosen.id] += 1
        else:
            cold_homes.setdefault(group, Counter())[chosen.id] += 1
        running.append((chosen.id, history, group))

    def new_session() -> None:
        group = 0 if rng.random() < 0.5 else rng.randint(1, 15)
        send(f"{systems[group]} {words(f'u{rng.random()}-', 30)}", group)

    for _ in range(16):
        new_session()
    for step in range(600):
        worker, history, group = running.pop(rng.randrange(len(running)))
        inflight[worker] -= 1
        if step % 4 == 3:  # a session's last turn: a new session takes its place
            new_session()
        else:
            send(f"{history} answer {step} {words(f't{step}-', 30)}", group)
    kept = sum(max(c.values()) for c in cold_homes.values())
    return hot, total, kept / sum(sum(c.values()) for c in cold_homes.values())


def test_skewed_traffic_spills_the_hot_prefix_and_keeps_the_rest_home() -> None:
    # Thresholds for workers that run about 8 requests at once (bench/routing/run.py).
    hot, total, kept = skewed_traffic({"balance_abs_threshold": 4, "balance_rel_threshold": 1.5})
    # Half the traffic needs two workers' worth: the hot prompt spreads over at least that,
    # no worker carries much more than its quarter, and the other groups still go home.
    assert len(hot) >= 2 and max(hot.values()) < 0.6 * sum(hot.values())
    assert max(total.values()) < 0.32 * sum(total.values())
    assert kept > 0.85
    # SGLang's defaults never trigger with 16 requests in flight: the hot prompt stays on
    # one worker, which then carries about half of all the traffic.
    hot, total, kept = skewed_traffic({})
    assert len(hot) == 1
    assert max(total.values()) > 0.45 * sum(total.values())


def test_cache_threshold_is_configurable() -> None:
    shared, rest = words("s", 100), words("r", 300)
    lenient = make({"cache_threshold": 0.1})
    lenient.insert(1, shared + " " + words("old", 300))
    assert ask(lenient, fleet(3), shared + " " + rest).id == 1
    assert lenient.decisions == {"prefix": 1}
    default = make()
    default.insert(1, shared + " " + words("old", 300))
    assert ask(default, fleet(3), shared + " " + rest).id != 1
    assert default.decisions == {"miss": 1}


def test_a_worker_left_out_of_the_candidates_is_never_picked() -> None:
    clock = Clock()
    policy, workers = make(clock=clock), fleet(3)
    text = words("gone", 300)
    policy.insert(2, text)
    assert ask(policy, workers, text).id == 2
    for i in range(20):
        assert ask(policy, workers[:2], f"{text} {i}").id != 2
        assert ask(policy, workers[:2], words(f"n{i}-", 50), {0: 50}).id == 1
    assert policy.match(text, [2])[0] > 0
    assert 2 not in policy.match(text, [0, 1])[1]
    # Its entries age out: after max_age_s the sweeps drop its whole tree.
    clock.now += 601
    for i in range(10):
        ask(policy, workers[:2], words(f"later{i}-", 30))
    assert policy.tree_size(2) == 0
    assert 2 not in policy._trees
    check_invariants(policy)


def test_no_workers_no_choice_and_no_text_routes_by_load() -> None:
    policy = make()
    assert policy.select([], RequestInfo("m", {}, (), text="hello"), {}).worker is None
    assert ask(policy, fleet(3), "", {0: 2, 1: 0, 2: 1}).id == 1
    assert policy.decisions == {"load": 1}
    assert policy.entries == 0


def test_a_new_snapshot_tuple_is_read_afresh() -> None:
    policy = make()
    text = words("snap", 300)
    first = tuple(fleet(2))
    policy.insert(0, text)
    assert ask(policy, first, text + " a").id == 0
    # The next snapshot: worker 0 reports a long queue, worker 1 is gone, worker 2 is new.
    second = (replace(first[0], weight=2.0), replace(first[1], id=2, name="w2"))
    assert ask(policy, second, text + " b", {0: 100}).id == 2
    assert ask(policy, first, text + " c").id == 0  # and back


# -- big fleets: the load index ----------------------------------------------------------------

BIG = 200  # > INDEX_MIN_WORKERS


def test_big_fleet_decides_as_the_scan_does_when_loads_differ() -> None:
    """From 128 workers the least loaded and the guard's minimum come from a LoadIndex; with
    distinct loads (no ties to draw) every decision is the scan's, hooks keeping it exact."""
    rng = random.Random(3)
    config = {"balance_abs_threshold": 3, "balance_rel_threshold": 1.0, "chunk_chars": 16}
    indexed, scanning = make(config), make(config)
    scanning._index.min_workers = 10**9
    workers = tuple(fleet(BIG))
    loads = list(range(BIG))
    rng.shuffle(loads)
    inflight = dict(enumerate(loads))  # a permutation: every load differs
    systems = [words(f"s{i}-", 30) for i in range(12)]
    for step in range(1500):
        text = rng.choice(systems) + " " + words(f"u{rng.randrange(50)}-", rng.randrange(1, 8))
        if step % 9 == 0:
            text = ""  # no prompt text: by load
        request = RequestInfo("m", {}, (), text=text)
        a = indexed.select(workers, request, inflight).worker
        b = scanning.select(workers, request, inflight).worker
        assert a is not None and a is b
        i, j = rng.sample(range(BIG), 2)  # two workers swap loads, as the hooks report
        inflight[i], inflight[j] = inflight[j], inflight[i]
        for policy in (indexed, scanning):
            policy.on_request_start(workers[i], request)
            policy.on_request_complete(workers[j], request, True)
    assert indexed.decisions == scanning.decisions
    assert set(indexed.decisions) == {"prefix", "load", "miss"}
    assert indexed._index.builds > 1500 // 256 and scanning._index.builds == 0


def test_big_fleet_miss_prefers_small_trees_among_the_least_loaded() -> None:
    """A miss takes the smallest tree among up to 8 of the workers tied at the least load:
    not always the smallest of all, but with half the trees big, hardly ever a big one."""
    policy = make()
    workers = tuple(fleet(BIG))
    for w in workers[: BIG // 2]:
        policy.insert(w.id, words(f"big{w.id}-", 400))
    busy = {w.id: 1 for w in workers[BIG // 2 : BIG // 2 + 20]}  # 20 small trees: not least
    chosen = [ask(policy, workers, words(f"new{i}-", 20), busy).id for i in range(60)]
    assert all(c not in busy for c in chosen)
    assert sum(c >= BIG // 2 for c in chosen) >= 55
    assert policy.decisions == {"miss": 60}


# -- configuration -----------------------------------------------------------------------------


def test_defaults() -> None:
    policy = PrefixAwarePolicy()
    assert policy.name == "prefix_aware"
    assert policy.needs_request_text is True
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.5, 32)
    assert (policy.balance_rel_threshold, policy.chunk_chars) == (1.1, 128)
    assert (policy.chunk_doubling, policy.max_entries, policy.max_age_s) == (8, 100_000, 600)


@pytest.mark.parametrize(
    "config",
    [
        {"cache_threshold": 1.5},
        {"cache_threshold": -0.1},
        {"cache_threshold": "0.5"},
        {"cache_threshold": math.nan},
        {"balance_abs_threshold": -1},
        {"balance_abs_threshold": True},
        {"balance_rel_threshold": 0.9},
        {"balance_rel_threshold": math.inf},
        {"chunk_chars": 4},
        {"chunk_chars": 64.0},
        {"chunk_chars": 1 << 20},
        {"chunk_doubling": -1},
        {"max_entries": 0},
        {"max_entries": None},
        {"max_age_s": 0},
        {"max_age_s": -5},
        {"cache_treshold": 0.5},
    ],
)
def test_bad_config_raises_value_error(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="prefix_aware"):
        PrefixAwarePolicy(config)


def test_good_config_is_taken() -> None:
    policy = PrefixAwarePolicy(
        {
            "cache_threshold": 1,
            "balance_abs_threshold": 0,
            "balance_rel_threshold": 1,
            "chunk_chars": 64,
            "chunk_doubling": 0,
            "max_entries": 10,
            "max_age_s": 0.5,
        }
    )
    assert (policy.cache_threshold, policy.chunk_chars, policy.max_entries) == (1.0, 64, 10)
    assert (policy.chunk_doubling, policy.max_age_s) == (0, 0.5)
