"""The cache-aware policies' load guard under a model's cap on requests in flight
(routing.policies.base.capped_guard, handed over by routing.state at every snapshot): a cap
of 6 over 4 workers never lets the configured threshold (32) trip, so sessions that share a
long system prompt would all pile onto one worker."""

from __future__ import annotations

import random

from bench.common.workers import worker_view
from routing.fleet.snapshot import ModelRoute
from routing.policies.base import PolicyContext, RequestInfo, capped_guard
from routing.policies.prefix_aware import PrefixAwarePolicy
from routing.state import slots_per_worker
from tests.support.kv_aware import BLOCK, holds, indexed, request, tokens

SHARED = "You are a coding agent. Tools: read, write, run. " * 60
HOT = {0: 3, 1: 0, 2: 0, 3: 0}  # the worker holding the prompt has 3 in flight, the rest none


def test_the_guard_is_the_configured_threshold_without_a_cap() -> None:
    assert capped_guard(32, 0) == 32
    assert capped_guard(32, 2) == 2
    assert capped_guard(1, 5) == 1  # a lower configured threshold stays


def test_the_slots_per_worker_are_the_cap_over_the_routable_workers_rounded_up() -> None:
    four = tuple(worker_view(i) for i in range(4))
    assert slots_per_worker(ModelRoute("m", "prefix_aware", {}, four, max_inflight=6)) == 2
    assert slots_per_worker(ModelRoute("m", "prefix_aware", {}, four, max_inflight=0)) == 0
    assert slots_per_worker(ModelRoute("m", "prefix_aware", {}, (), max_inflight=6)) == 0
    prefill = four[:3]  # a disaggregated model's policy chooses among its prefill workers
    route = ModelRoute("m", "kv_aware", {}, four[3:], max_inflight=6, prefill=prefill)
    assert slots_per_worker(route) == 2


def prefix_choice(slots: int) -> tuple[int | None, str]:
    policy = PrefixAwarePolicy(rng=random.Random(0))
    policy.attach(PolicyContext(None, slots))
    policy.insert(0, SHARED)
    workers = [worker_view(i) for i in range(4)]
    body = {"model": "m", "prompt": SHARED + "turn 2"}
    info = RequestInfo("m", body, (), text=SHARED + "turn 2")
    choice = policy.select(workers, info, HOT)
    return (choice.worker.id if choice.worker else None), choice.decision


def test_prefix_aware_keeps_the_session_below_its_share_of_the_cap() -> None:
    assert prefix_choice(slots=0) == (0, "prefix")  # no cap: 3 - 0 is under 32
    assert prefix_choice(slots=4) == (0, "prefix")  # not past its share
    worker, decision = prefix_choice(slots=2)  # 3 in flight where 2 are its share
    assert worker != 0 and decision == "load"


def test_kv_aware_spills_past_its_share_of_the_cap_and_a_new_snapshot_can_lift_it() -> None:
    policy, workers, index = indexed(4, empty=(1, 2, 3))
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 0, prompt[: 30 * BLOCK])
    policy.attach(PolicyContext(index, 2))
    choice = policy.select(workers, request(prompt), HOT)
    assert choice.worker is not None and choice.worker.id != 0 and choice.decision == "load"
    policy.attach(PolicyContext(index, 0))  # the cap removed at the next snapshot
    choice = policy.select(workers, request(prompt), HOT)
    assert choice.worker is not None and choice.worker.id == 0 and choice.decision == "kv"
