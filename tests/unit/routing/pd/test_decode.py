"""The decode leg's worker (routing.pd.decode): the least fused load, then the lower KV
cache usage, then at random."""

from __future__ import annotations

from collections import Counter

from bench.common.workers import worker_view
from routing.pd.decode import DecodeByLoad
from routing.policies.base import RequestInfo

REQUEST = RequestInfo("m", {}, [])


def test_the_least_loaded_worker_decodes_and_kv_usage_breaks_a_tie() -> None:
    policy = DecodeByLoad()
    workers = [worker_view(1, kv_cache_usage=0.1), worker_view(2, kv_cache_usage=0.5),
               worker_view(3, kv_cache_usage=0.2)]  # fmt: skip
    assert policy.select(workers, REQUEST, {1: 2, 2: 1, 3: 1}).worker == workers[2]
    assert policy.select(workers, REQUEST, {}).worker == workers[0]
    assert policy.select([], REQUEST, {}).worker is None


def test_a_full_tie_is_spread_at_random() -> None:
    policy = DecodeByLoad()
    workers = [worker_view(i) for i in (1, 2, 3)]  # no KV usage known: 0 for each
    picks = Counter(policy.select(workers, REQUEST, {}).worker.id for _ in range(3000))  # type: ignore[union-attr]
    assert set(picks) == {1, 2, 3} and min(picks.values()) > 800  # 1000 +- 7 sigma
