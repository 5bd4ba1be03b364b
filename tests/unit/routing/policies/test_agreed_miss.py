"""prefix_aware's miss_spread (routing/policies/agreed_miss.py): two routers that see the
same new prefix at once, each before hearing of the other's decision, put it on one worker;
the rule never strays more than the spread from the least loaded, and every process
computes it alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from routing.policies.agreed_miss import agreed_position
from tests.support.kv_aware import BLOCK, indexed, request, tokens
from tests.support.kv_aware import ask as kv_ask
from tests.support.kv_aware import make as kv_make
from tests.support.prefix_aware import ask, fleet, make, words

SYSTEM = words("system", 400)  # one long system prompt, new to every worker


def first_turns(spread: float) -> tuple[int, int]:
    """Router A routes one user's first turn; router B, which has not heard of it yet,
    another's a moment later, with A's request already counted in the loads (pushed)."""
    a, b = make({"miss_spread": spread}), make({"miss_spread": spread})
    workers = fleet(4)
    loads = {0: 1, 1: 0, 2: 0, 3: 0}  # some earlier traffic on worker 0
    first = ask(a, workers, SYSTEM + " user one asks", loads)
    loads[first.id] += 1
    second = ask(b, workers, SYSTEM + " user two asks something else", loads)
    return first.id, second.id


def test_two_routers_put_the_same_new_prefix_on_one_worker() -> None:
    first, second = first_turns(2)
    assert first == second


def test_without_a_spread_the_second_router_sends_it_elsewhere() -> None:
    first, second = first_turns(0)  # the default: least loaded, so a second prefill
    assert first != second


def test_a_miss_never_goes_past_the_spread_over_the_least_loaded() -> None:
    loads = [7, 3, 4, 9, 5, 3]
    ids = list(range(10, 16))
    for key in range(200):
        chosen = agreed_position(loads, ids, key, 1)
        assert loads[chosen] <= min(loads) + 1
    picks = {agreed_position(loads, ids, key, 1) for key in range(200)}
    assert picks == {1, 2, 5}  # every worker in reach takes some prefixes


def test_every_process_computes_the_same_choice() -> None:
    loads, ids = [0, 0, 0, 0, 0, 0, 0, 0], [3, 14, 15, 92, 65, 35, 89, 79]
    here = [agreed_position(loads, ids, key, 2) for key in range(0, 10**6, 9973)]
    code = (
        "from routing.policies.agreed_miss import agreed_position as p\n"
        f"print([p({loads}, {ids}, k, 2) for k in range(0, 10**6, 9973)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashing differs; ints must not
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert there.strip() == str(here)
    assert len(set(here)) == len(ids)


@pytest.mark.parametrize("bad", [-1, "2", True, float("nan")])
def test_a_bad_miss_spread_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="miss_spread"):
        make({"miss_spread": bad})


def kv_first_turns(spread: float) -> tuple[int, int]:
    """kv_aware: each router's pending credit is its own until the worker's events show
    the blocks (a whole prefill later), so the second router sees a miss too."""
    system = tokens(7, 64 * BLOCK)
    a, workers, index = indexed(4, empty=range(4), miss_spread=spread, pending_seconds=10)
    b = kv_make(miss_spread=spread, pending_seconds=10)
    b.kv_index = index
    loads = {0: 1, 1: 0, 2: 0, 3: 0}
    first = kv_ask(a, workers, request([*system, *tokens(8, 2 * BLOCK)]), loads)
    loads[first.id] += 1
    second = kv_ask(b, workers, request([*system, *tokens(9, 3 * BLOCK)]), loads)
    return first.id, second.id


def test_kv_aware_routers_put_the_same_new_prefix_on_one_worker() -> None:
    assert len(set(kv_first_turns(2))) == 1
    assert len(set(kv_first_turns(0))) == 2  # the default: a second prefill
