"""power_of_two: the less loaded of two distinct workers drawn at random; SGLang's test of three
workers at loads 10, 5 and 0.

Distribution tests count choices over thousands of calls with seeded generators where the
policy has one, so they are deterministic."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import pytest

from routing.fleet.load_signal import LoadBoard
from routing.policies.power_of_two import PowerOfTwoPolicy
from tests.support.policy_views import (
    NO_INFLIGHT,
    REQUEST,
    counts,
    fleet,
    worker,
)


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
    assert PowerOfTwoPolicy().select((only,), REQUEST, NO_INFLIGHT).worker is only
