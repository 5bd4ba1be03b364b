"""prefix_aware in process: a policy on a clock of the test's, a fleet, prompts of distinct
words, asking it for a worker, where its chunks end, and checking its trees' invariants."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from bench.common.workers import worker_view
from routing.fleet.snapshot import WorkerView
from routing.policies.base import RequestInfo
from routing.policies.prefix_aware import PrefixAwarePolicy


def fleet(n: int) -> list[WorkerView]:
    return [worker_view(i) for i in range(n)]


def words(tag: str, n: int) -> str:
    """n distinct words, all different from another tag's."""
    return " ".join(f"{tag}{i}" for i in range(n))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(config: Mapping[str, Any] | None = None, clock: Clock | None = None) -> PrefixAwarePolicy:
    return PrefixAwarePolicy(config, clock=clock or Clock(), rng=random.Random(0))


def ask(
    policy: PrefixAwarePolicy,
    workers: Sequence[WorkerView],
    text: str,
    inflight: Mapping[int, int] | None = None,
) -> WorkerView:
    chosen = policy.select(workers, RequestInfo("m", {}, (), text=text), inflight or {}).worker
    assert chosen is not None
    return chosen


def chunk_ends(policy: PrefixAwarePolicy, n: int) -> list[int]:
    """Where the chunks of an n-byte prompt end (the last one past n when it is short)."""
    policy._chain("x" * n)
    return [end for start, end in zip(policy._starts, policy._ends, strict=True) if start < n]


def check_invariants(policy: PrefixAwarePolicy) -> None:
    """Sizes, totals and indexes agree with the trees; marks are few and in order."""
    chunks = {w: [k for k, v in t.items() if v is None] for w, t in policy._trees.items()}
    assert policy._sizes == {w: len(keys) for w, keys in chunks.items()}
    assert policy.entries == sum(policy._sizes.values()) <= policy.max_entries
    for key, holders in policy._heads.items():
        assert holders
        assert set(holders) == {w for w, keys in chunks.items() if key in keys}
        assert all(policy._trees[w] is tree for w, tree in holders.items())
    for w, tree in policy._trees.items():
        marks = [k for k, v in tree.items() if v is not None]
        assert marks == list(policy._marks[w])
        assert len(marks) <= 34
        times = [tree[m] or 0.0 for m in marks]
        assert times == sorted(times)
