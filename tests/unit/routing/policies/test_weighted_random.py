"""random: workers drawn in proportion to their weights (seeded, so deterministic).

Distribution tests count choices over thousands of calls with seeded generators where the
policy has one, so they are deterministic."""

from __future__ import annotations

from routing.policies.weighted_random import WeightedRandomPolicy
from tests.support.policy_views import (
    counts,
    fleet,
    worker,
)


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
