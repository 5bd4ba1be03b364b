"""round_robin: workers in id order, whatever their load, and stable as the list changes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from routing.fleet.snapshot import WorkerView
from routing.policies.round_robin import RoundRobinPolicy
from tests.support.policy_views import (
    NO_INFLIGHT,
    REQUEST,
    counts,
    worker,
)


def test_round_robin_even_counts_in_id_order() -> None:
    policy = RoundRobinPolicy()
    workers = (worker(3), worker(1), worker(2))
    picks = [policy.select(workers, REQUEST, NO_INFLIGHT).worker for _ in range(300)]
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
            w.id
            for w in (policy.select(workers, REQUEST, NO_INFLIGHT).worker for _ in range(calls))
            if w
        ]

    assert ids((one, two, three), 2) == [1, 2]
    assert ids([one, two, three, four], 3) == [3, 4, 1]  # a joiner slots in by id
    assert ids((one, three, four), 3) == [3, 4, 1]  # 2 left: skipped, nobody picked twice
    assert ids((four,), 2) == [4, 4]
    assert ids((one, two), 3) == [1, 2, 1]  # the last id (4) is gone: wrap around
    assert policy.select((), REQUEST, NO_INFLIGHT).worker is None
