"""kv_aware on the exact index, in process: a policy, a fleet, token ids, requests, and a
worker's KV events storing a prompt (the index fed as its subscriber feeds it)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from bench.common.workers import worker_view
from routing.fleet.snapshot import WorkerView
from routing.kv.kv_index import KvIndex
from routing.policies.base import Choice, RequestInfo
from routing.policies.kv_aware import KvAwarePolicy

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(**config: Any) -> KvAwarePolicy:
    """The rule on the exact index alone: the pending credit is off unless asked for (its
    own tests: tests/unit/routing/policies/test_kv_pending.py)."""
    config.setdefault("pending_seconds", 0)
    return KvAwarePolicy(config, clock=Clock(), rng=random.Random(0))


def fleet(n: int, block_size: int | None = None) -> list[WorkerView]:
    """n workers whose vllm:cache_config_info states `block_size` (default BLOCK)."""
    return [worker_view(i, kv_block_size=block_size or BLOCK) for i in range(n)]


def tokens(tag: int, n: int) -> list[int]:
    """n token ids, different from another tag's."""
    return [tag * 100_000 + i for i in range(n)]


def request(ids: Sequence[int] | None, text: str | None = None, model: str = "m") -> RequestInfo:
    body = {"model": model, "prompt": text if text is not None else " ".join(map(str, ids or ()))}
    return RequestInfo(model, body, (), tokens=ids)


def ask(
    policy: KvAwarePolicy,
    workers: Sequence[WorkerView],
    info: RequestInfo,
    loads: Mapping[int, int] | None = None,
) -> WorkerView:
    worker = decide(policy, workers, info, loads).worker
    assert worker is not None
    return worker


def decide(
    policy: KvAwarePolicy,
    workers: Sequence[WorkerView],
    info: RequestInfo,
    loads: Mapping[int, int] | None = None,
) -> Choice:
    """The policy's whole choice: its worker (never None here), decision and prediction."""
    choice = policy.select(workers, info, loads or {})
    assert choice.worker is not None
    return choice


def holds(index: KvIndex, worker_id: int, ids: Sequence[int], lora: str | None = None) -> None:
    """The worker stores the prompt's full blocks, as its next event batch says (the first
    batch of an engine, numbered 0, makes its index trusted)."""
    index.check_sequence(worker_id, index.expected_seq(worker_id) or 0)
    blocks = len(ids) // BLOCK
    vllm_hashes = [
        hash(("vllm", worker_id, lora, tuple(ids[: (i + 1) * BLOCK]))) for i in range(blocks)
    ]
    index.store(worker_id, vllm_hashes, None, ids[: blocks * BLOCK], BLOCK, lora)


def indexed(
    n: int, *, empty: Sequence[int] = (), **config: Any
) -> tuple[KvAwarePolicy, list[WorkerView], KvIndex]:
    """A policy over n workers and an exact index in which the workers `empty` have an
    empty (trusted) cache; the others are unknown until they store something."""
    policy, index = make(**config), KvIndex()
    policy.kv_index = index
    for worker_id in empty:
        index.clear(worker_id)
    return policy, fleet(n), index
