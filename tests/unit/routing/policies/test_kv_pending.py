"""kv_aware's pending credit (routing.policies.kv_pending): the chosen worker is credited with
a request's leading blocks until its own KV events show them, so a burst sharing a new
prefix stays on one worker instead of being spread over all. Pure unit tests."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from bench.common.workers import worker_view
from routing.fleet.snapshot import ModelEntry
from routing.kv.kv_index import KvIndex, chain_hashes
from routing.policies.base import Choice
from routing.policies.kv_aware import KvAwarePolicy
from routing.policies.kv_pending import LazyChain, PendingBlocks
from tests.support.kv_aware import BLOCK, Clock, ask, decide, fleet, holds, request, tokens


def pending_policy(n: int, **config: Any) -> tuple[KvAwarePolicy, Clock, KvIndex]:
    """A policy over n workers whose exact indexes are all trusted and empty."""
    clock = Clock()
    policy, index = KvAwarePolicy(config, clock=clock, rng=random.Random(0)), KvIndex()
    policy.kv_index = index
    for worker_id in range(n):
        index.clear(worker_id)
    return policy, clock, index


def burst(
    policy: KvAwarePolicy, n_workers: int, prefix: list[int], count: int
) -> tuple[Counter[int], Choice]:
    """`count` requests sharing `prefix`, each counted in flight on its worker, no events;
    how many went to each worker, and the last one's choice."""
    workers, loads = fleet(n_workers), dict.fromkeys(range(n_workers), 0)
    chosen: Counter[int] = Counter()
    for i in range(count):
        choice = decide(policy, workers, request([*prefix, *tokens(50 + i, BLOCK)]), loads)
        assert choice.worker is not None
        loads[choice.worker.id] += 1
        chosen[choice.worker.id] += 1
    return chosen, choice


def test_a_burst_sharing_a_new_prefix_stays_on_one_worker() -> None:
    prefix = tokens(1, 64 * BLOCK)
    policy, _, _ = pending_policy(4)
    # 64 blocks saved outweigh 8 requests in flight (load_weight 8): all 8 go together.
    chosen, last = burst(policy, 4, prefix, 8)
    assert list(chosen.values()) == [8]
    assert policy.decisions == {"miss": 1, "pending": 7}
    assert last.prediction is not None and last.prediction.tokens == 64 * BLOCK
    # Without the credit the index knows nothing yet and load spreads them over every worker.
    off, _, _ = pending_policy(4, pending_seconds=0)
    assert sorted(burst(off, 4, prefix, 8)[0].values()) == [2, 2, 2, 2]


def test_the_credit_ends_soon_after_the_answer_starts() -> None:
    prefix = tokens(1, 32 * BLOCK)
    policy, clock, index = pending_policy(3)
    workers, loads = fleet(3), {0: 0, 1: 0, 2: 0}
    first_request, second_request, third_request = (request(prefix) for _ in range(3))
    first = ask(policy, workers, first_request, loads)
    loads[first.id] = 1
    clock.now += 3  # prefilling: no event yet, the credit stands
    choice = decide(policy, workers, second_request, loads)
    assert choice.worker.id == first.id
    assert choice.decision == "pending"
    policy.on_request_complete(first, second_request, True)
    policy.on_first_byte(first, first_request)
    clock.now += 0.04  # the events are still on their way
    assert ask(policy, workers, third_request, loads).id == first.id
    policy.on_request_complete(first, third_request, True)
    clock.now += 0.02  # the answer started 60 ms ago and the events never showed the blocks
    choice = decide(policy, workers, request(prefix), loads)
    assert choice.worker.id != first.id
    assert choice.decision == "miss"
    # What the events say stands on its own once they come.
    holds(index, first.id, prefix)
    choice = decide(policy, workers, request(prefix), {})
    assert choice.worker.id == first.id
    assert choice.decision == "kv"


def test_a_failed_attempt_ends_its_credit_and_a_retry_moves_it() -> None:
    prefix = tokens(1, 32 * BLOCK)
    policy, _, _ = pending_policy(2)
    workers, retried = fleet(2), request(prefix)
    first = ask(policy, workers, retried, {})
    policy.on_request_complete(first, retried, False)  # failed before its first byte
    assert len(policy.pending) == 0
    second = ask(policy, workers, retried, {first.id: 5})
    assert second.id != first.id
    assert policy.pending.depths({0: chain(prefix), 1: chain(prefix)}) == {second.id: 32}


def test_the_credit_lapses_after_pending_seconds_if_no_answer_starts() -> None:
    prefix = tokens(1, 32 * BLOCK)
    policy, clock, _ = pending_policy(2, pending_seconds=2)
    workers = fleet(2)
    first = ask(policy, workers, request(prefix), {})
    clock.now += 1.9
    assert ask(policy, workers, request(prefix), {first.id: 1}).id == first.id
    clock.now += 2.1  # both lapsed
    choice = decide(policy, workers, request(prefix), {first.id: 1})
    assert choice.decision == "miss"


def test_the_events_win_where_they_hold_more_than_the_credit() -> None:
    prefix = tokens(1, 40 * BLOCK)
    policy, _, index = pending_policy(2)
    workers = fleet(2)
    credited = ask(policy, workers, request(prefix[: 10 * BLOCK]), {}).id
    other = 1 - credited
    holds(index, other, prefix)
    choice = decide(policy, workers, request(prefix), {})
    assert choice.worker.id == other
    assert choice.decision == "kv"


def test_explain_shows_the_credit_and_credits_nothing() -> None:
    prefix = tokens(1, 20 * BLOCK)
    policy, _, _ = pending_policy(2)
    workers = fleet(2)
    chosen = ask(policy, workers, request(prefix), {})
    credited = len(policy.pending)
    told = policy.explain(workers, request([*prefix, 1]), {})
    assert told.decision == "pending" and told.worker is not None and told.worker.id == chosen.id
    row = told.candidates[0]
    assert row["worker"] == chosen.name and row["source"] == "pending"
    assert row["cached_tokens"] == 20 * BLOCK
    assert told.candidates[1]["source"] == "events" and told.candidates[1]["cached_tokens"] == 0
    assert len(policy.pending) == credited


def test_an_adapters_credit_never_matches_the_base_model() -> None:
    lora = (ModelEntry("m"), ModelEntry("m-lora", parent="m"))
    workers = [worker_view(i, models=lora, kv_block_size=BLOCK) for i in range(2)]
    policy, _, _ = pending_policy(2)
    prompt = tokens(1, 20 * BLOCK)
    ask(policy, workers, request(prompt, model="m-lora"), {})
    choice = decide(policy, workers, request(prompt, model="m"), {})
    assert choice.decision == "miss"
    choice = decide(policy, workers, request(prompt, model="m-lora"), {})
    assert choice.decision == "pending"


def chain(ids: list[int], start: int = 0, end: int | None = None) -> LazyChain:
    """The chain of `ids` from block `start`, its first key made the index's way."""
    keys = chain_hashes(ids, None, BLOCK)
    return LazyChain(ids, BLOCK, start, keys[start], len(keys) if end is None else end)


def test_depths_are_each_workers_longest_credited_run() -> None:
    clock = Clock()
    pending = PendingBlocks(5, clock)
    ids = tokens(1, 12 * BLOCK)
    pending.credit(1, chain(ids, end=3), "a")
    pending.credit(2, chain(ids, end=10), "b")
    pending.credit(2, chain(ids, end=5), "c")  # a shorter credit beside the longer one
    pending.credit(3, chain(tokens(2, 4 * BLOCK)), "d")
    asked = dict.fromkeys([1, 2, 3, 4], chain(ids))
    assert pending.depths(asked) == {1: 3, 2: 10} and pending.blocks == 22
    pending.end("b")  # the shorter credit keeps its blocks when the longer one ends
    assert pending.depths({1: chain(ids), 2: chain(ids)}) == {1: 3, 2: 5}
    pending.confirm("c")
    clock.now += 0.049
    assert pending.depths({2: chain(ids)}) == {2: 5}
    clock.now += 0.002
    assert pending.depths({2: chain(ids)}) == {}
    clock.now += 5  # every credit has lapsed
    assert pending.depths({1: chain(ids)}) == {} and len(pending) == pending.blocks == 0


def test_a_credit_counts_from_where_the_asking_worker_stops() -> None:
    pending = PendingBlocks(5, Clock())
    ids = tokens(1, 40 * BLOCK)
    pending.credit(1, chain(ids, start=30), "a")  # its events showed blocks 0-29
    assert pending.depths({1: chain(ids, start=30)}) == {1: 10}
    assert pending.depths({1: chain(ids, start=29)}) == {}  # block 29 evicted since
    other = [*ids[: 35 * BLOCK], *tokens(2, 5 * BLOCK)]  # shares blocks 0-34 only
    assert pending.depths({1: chain(other, start=30)}) == {1: 5}


def test_keys_are_hashed_only_when_compared() -> None:
    ids = tokens(3, 9 * BLOCK + 3)
    whole = chain_hashes(ids, None, BLOCK)
    lazy = chain(ids, start=2)
    assert len(lazy) == 7 and lazy.key(0) == whole[2]
    assert lazy.key(6) == whole[8] and lazy.key(3) == whole[5]


def test_memory_is_bounded_oldest_credits_first() -> None:
    clock = Clock()
    pending = PendingBlocks(60, clock, max_blocks=100)
    for tag in range(20):
        clock.now += 0.1
        pending.credit(tag % 4, chain(tokens(tag, 10 * BLOCK)), tag)
    assert pending.blocks == 100 and len(pending) == 10
    everyone = range(4)
    assert pending.depths(dict.fromkeys(everyone, chain(tokens(0, 10 * BLOCK)))) == {}
    assert pending.depths(dict.fromkeys(everyone, chain(tokens(19, 10 * BLOCK)))) == {3: 10}


def test_a_request_is_credited_its_leading_blocks_only() -> None:
    policy, _, _ = pending_policy(2)
    ask(policy, fleet(2), request(tokens(1, 300 * BLOCK + 5)), {})
    assert policy.pending.blocks == policy.pending.max_request_blocks == 256


def test_only_blocks_past_what_the_events_show_are_credited() -> None:
    prefix = tokens(1, 40 * BLOCK)
    policy, _, index = pending_policy(2)
    workers = fleet(2)
    holds(index, 1, prefix[: 30 * BLOCK])
    assert ask(policy, workers, request(prefix), {}).id == 1
    assert policy.pending.blocks == 10  # blocks 30-39: the events show the rest
    choice = decide(policy, workers, request([*prefix, 5]), {})
    assert choice.worker.id == 1
    assert choice.decision == "pending" and choice.prediction is not None
    assert choice.prediction.tokens == 40 * BLOCK


def test_a_request_never_counts_its_own_credit() -> None:
    prefix = tokens(1, 32 * BLOCK)
    policy, _, _ = pending_policy(2)
    workers, same = fleet(2), request(prefix)
    first = ask(policy, workers, same, {})
    # Asked again before its answer started.
    choice = decide(policy, workers, same, {first.id: 1})
    assert choice.decision == "miss"  # its own credit is what it is to compute
    choice = decide(policy, workers, request(prefix), {})
    assert choice.decision == "pending"  # another request's credit counts


def test_each_worker_is_credited_in_its_own_block_size() -> None:
    # vLLM on CPUs uses 128-token blocks, GPU backends 16 or 32: a mixed fleet is credited,
    # matched and predicted in each worker's own size, as its cache_config_info states it.
    policy, _, _ = pending_policy(2)
    workers = [worker_view(0, kv_block_size=32), worker_view(1, kv_block_size=128)]
    for sizes_first in range(2):
        prompt = tokens(1 + sizes_first, 4 * 128 + 7)
        loads = {0: 0, 1: 0}
        loads[1 - sizes_first] = 1  # steer the miss to worker `sizes_first`
        choice = decide(policy, workers, request(prompt), loads)
        first = choice.worker
        assert first.id == sizes_first and choice.decision == "miss"
        choice = decide(policy, workers, request(prompt), loads)
        again = choice.worker
        assert again.id == first.id and choice.decision == "pending"
        prediction = choice.prediction
        assert prediction is not None and prediction.block_size == workers[first.id].kv_block_size
        assert prediction.tokens == 4 * 128  # whole blocks of either size: 16x32 or 4x128
    assert "block_size_unknown" not in policy.fallbacks


def test_a_worker_whose_block_size_is_unknown_is_not_credited_and_it_is_counted() -> None:
    policy, _, _ = pending_policy(1)
    workers = [worker_view(0)]  # no events stored yet, no cache_config_info scraped
    prompt = tokens(1, 8 * BLOCK)
    ask(policy, workers, request(prompt), {})
    choice = decide(policy, workers, request(prompt), {})
    assert choice.decision == "miss"  # no credit: its blocks' size is not known
    assert policy.fallbacks["block_size_unknown"] == 2
