"""The exact KV index: store, remove, clear, sequence gaps, replay, LoRA and its memory cap.

Events are fed as the subscriber feeds them (check_sequence, then the events), with block
hashes that are arbitrary opaque numbers, as vLLM's are to the router."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from routing.kv.kv_index import KvIndex, SeqVerdict, Trust, chain_hashes

BS = 4
W = 1  # a worker id
PROMPT = list(range(100, 116))  # 4 full blocks


def blocks_of(tokens: Sequence[int]) -> list[list[int]]:
    return [list(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS)]


def store_prompt(
    index: KvIndex, tokens: Sequence[int], hashes: Sequence[int], lora: str | int | None = None
) -> None:
    """vLLM storing a prompt's blocks one event per block, each chained to the previous."""
    parent = None
    for block, block_hash in zip(blocks_of(tokens), hashes, strict=False):
        index.store(W, [block_hash], parent, block, BS, lora)
        parent = block_hash


def ready_index(**options: int) -> KvIndex:
    index = KvIndex(**options)
    assert index.check_sequence(W, 0) is SeqVerdict.APPLY  # an engine's first batch
    return index


def test_a_worker_without_events_is_unknown() -> None:
    index = KvIndex()
    assert index.cached_blocks(W, PROMPT) is None
    assert index.status(W) is None


def test_stored_blocks_match_the_leading_blocks_of_a_request() -> None:
    index = ready_index()
    assert index.cached_blocks(W, PROMPT) == 0  # trusted and empty: zero, not unknown
    store_prompt(index, PROMPT, [501, 502, 503])  # the first 3 of 4 blocks
    assert index.cached_blocks(W, PROMPT) == 3
    assert index.cached_blocks(W, PROMPT[:9]) == 2  # a partial block never counts
    assert index.cached_blocks(W, [*PROMPT, 1, 2, 3]) == 3
    other = [PROMPT[0] + 1000, *PROMPT[1:]]  # first token differs: nothing chains
    assert index.cached_blocks(W, other) == 0
    assert index.status(W).blocks == 3  # type: ignore[union-attr]


def test_one_event_with_several_blocks_chains_them() -> None:
    index = ready_index()
    index.store(W, [7, 8], None, PROMPT[:8], BS, None)
    index.store(W, [9, 10], 8, PROMPT[8:], BS, None)  # parent: the last block of the first
    assert index.cached_blocks(W, PROMPT) == 4


def test_removed_blocks_end_the_match_there() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    index.remove(W, [3])
    assert index.cached_blocks(W, PROMPT) == 2  # block 4 is still held, but unreachable
    index.remove(W, [999])  # an unknown hash: ignored
    index.remove(W, [1])
    assert index.cached_blocks(W, PROMPT) == 0


def test_a_block_stored_under_two_hashes_stays_until_both_are_removed() -> None:
    # Extra keys (a cache salt) give vLLM two hashes for the same tokens.
    index = ready_index()
    index.store(W, [1], None, PROMPT[:4], BS, None)
    index.store(W, [2], None, PROMPT[:4], BS, None)
    index.remove(W, [1])
    assert index.cached_blocks(W, PROMPT) == 1
    index.remove(W, [2])
    assert index.cached_blocks(W, PROMPT) == 0


def test_a_hash_stored_twice_stays_until_each_physical_block_is_removed() -> None:
    # vLLM 0.32 stores a recomputed identical block again under the same hash (a second
    # physical block) and sends one BlockRemoved per physical block.
    index = ready_index()
    index.store(W, [1], None, PROMPT[:4], BS, None)
    index.store(W, [1], None, PROMPT[:4], BS, None)
    index.remove(W, [1])
    assert index.cached_blocks(W, PROMPT) == 1
    index.remove(W, [1])
    assert index.cached_blocks(W, PROMPT) == 0
    index.remove(W, [1])  # one too many (an event lost upstream): harmless
    assert index.cached_blocks(W, PROMPT) == 0


def test_all_blocks_cleared_empties_and_trusts() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    index.clear(W)
    assert index.cached_blocks(W, PROMPT) == 0
    assert index.status(W).clears == 1  # type: ignore[union-attr]


def test_a_child_of_an_unknown_parent_is_skipped_and_counted() -> None:
    index = ready_index()
    index.store(W, [2], 1, PROMPT[4:8], BS, None)  # parent 1 was never stored
    assert index.cached_blocks(W, PROMPT) == 0
    assert index.status(W).orphans == 1  # type: ignore[union-attr]


def test_lora_blocks_match_only_their_adapter() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4], lora="sql-adapter")
    assert index.cached_blocks(W, PROMPT, "sql-adapter") == 4
    assert index.cached_blocks(W, PROMPT) == 0  # the base model
    assert index.cached_blocks(W, PROMPT, "other-adapter") == 0
    # Older engines send only vLLM's lora_id: those blocks key by the number.
    store_prompt(index, PROMPT, [11, 12, 13, 14], lora=3)
    assert index.cached_blocks(W, PROMPT, 3) == 4
    assert index.cached_blocks(W, PROMPT, "sql-adapter") == 4


def test_chain_computed_once_matches_per_worker() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2])
    assert index.check_sequence(2, 0) is SeqVerdict.APPLY
    index.store(2, [5, 6, 7], None, PROMPT[:12], BS, None)
    chain = chain_hashes(PROMPT, None, BS)
    assert len(chain) == 4
    assert index.cached_blocks_in_chain(W, chain, BS) == 2
    assert index.cached_blocks_in_chain(2, chain, BS) == 3
    assert index.cached_blocks_in_chain(3, chain, BS) is None  # no events from worker 3


def test_another_block_size_is_not_comparable() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    assert index.block_size(W) == BS
    assert index.cached_blocks(W, PROMPT, block_size=8) is None
    assert index.cached_blocks(W, PROMPT, block_size=BS) == 4


def test_a_gap_makes_the_worker_unknown_until_cleared() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    assert index.check_sequence(W, 1) is SeqVerdict.APPLY
    assert index.check_sequence(W, 3) is SeqVerdict.GAP  # batch 2 (a removal?) was lost
    assert index.cached_blocks(W, PROMPT) is None
    assert index.check_sequence(W, 4) is SeqVerdict.APPLY  # the stream goes on...
    assert index.cached_blocks(W, PROMPT) is None  # ...but stays untrusted
    index.clear(W)  # the cache is known empty from here
    assert index.cached_blocks(W, PROMPT) == 0
    status = index.status(W)
    assert status is not None and (status.gaps, status.trust) == (1, Trust.READY)


def test_a_replay_that_fills_the_gap_restores_trust() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2])
    assert index.check_sequence(W, 1) is SeqVerdict.APPLY
    expected = index.expected_seq(W)
    assert index.check_sequence(W, 4) is SeqVerdict.GAP  # 2 and 3 missed
    index.begin_replay(W, expected)  # type: ignore[arg-type]
    for seq in (2, 3, 4):  # the replay resends from the first missed one
        assert index.check_sequence(W, seq) is SeqVerdict.APPLY
    index.store(W, [3], 2, PROMPT[8:12], BS, None)
    index.mark_replayed(W, complete=True)
    assert index.cached_blocks(W, PROMPT) == 3
    # The live socket queued 3 and 4 meanwhile: duplicates, not a restart.
    assert index.check_sequence(W, 3) is SeqVerdict.DUPLICATE
    assert index.check_sequence(W, 5) is SeqVerdict.APPLY
    assert index.cached_blocks(W, PROMPT) == 3


def test_a_replay_that_cannot_reach_back_leaves_it_unknown() -> None:
    index = ready_index()
    assert index.check_sequence(W, 1) is SeqVerdict.APPLY
    assert index.check_sequence(W, 9) is SeqVerdict.GAP
    index.begin_replay(W, 2)
    assert index.check_sequence(W, 6) is SeqVerdict.GAP  # the buffer starts at 6 now
    for seq in (7, 8, 9):
        index.check_sequence(W, seq)
    index.mark_replayed(W, complete=False)
    assert index.cached_blocks(W, PROMPT) is None


def test_joining_mid_stream_is_unknown_until_a_replay_from_zero() -> None:
    index = KvIndex()
    assert index.check_sequence(W, 40) is SeqVerdict.GAP  # what came before 40 is unseen
    assert index.cached_blocks(W, PROMPT) is None
    index.begin_replay(W, 0)
    for seq in range(41):
        index.check_sequence(W, seq)
        if seq == 3:
            store_prompt(index, PROMPT, [1, 2, 3, 4])
    index.mark_replayed(W, complete=True)
    assert index.cached_blocks(W, PROMPT) == 4


def test_an_empty_replay_means_an_engine_that_stored_nothing() -> None:
    index = KvIndex()
    index.begin_replay(W, 0)
    index.mark_empty(W)
    index.mark_replayed(W, complete=True)
    assert index.cached_blocks(W, PROMPT) == 0
    assert index.check_sequence(W, 0) is SeqVerdict.APPLY


def test_sequence_going_back_means_a_restart_and_empties() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    for seq in range(1, 6):
        index.check_sequence(W, seq)
    assert index.check_sequence(W, 0) is SeqVerdict.RESTART
    assert index.cached_blocks(W, PROMPT) == 0
    status = index.status(W)
    assert status is not None and status.restarts == 1 and status.blocks == 0


def test_a_restart_seen_late_is_unknown() -> None:
    index = ready_index()
    for seq in range(1, 6):
        index.check_sequence(W, seq)
    assert index.check_sequence(W, 2) is SeqVerdict.GAP  # restarted; 0 and 1 were missed
    assert index.cached_blocks(W, PROMPT) is None


def test_a_lost_stream_empties_and_is_unknown() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    index.lose_stream(W)
    assert index.cached_blocks(W, PROMPT) is None
    assert index.status(W).blocks == 0  # type: ignore[union-attr]


def test_lost_events_are_never_trusted_again_by_a_later_replay() -> None:
    index = ready_index()
    index.mark_unknown(W)  # a batch that could not be decoded: its events are lost
    assert index.check_sequence(W, 1) is SeqVerdict.APPLY
    assert index.check_sequence(W, 3) is SeqVerdict.GAP
    index.begin_replay(W, 2)
    index.check_sequence(W, 2)
    index.check_sequence(W, 3)
    index.mark_replayed(W, complete=True)  # fills the gap, not the lost batch
    assert index.cached_blocks(W, PROMPT) is None


def test_memory_is_bounded_by_dropping_the_oldest() -> None:
    index = ready_index(max_blocks_per_worker=64)
    prompts = [[p * 1000 + t for t in range(8)] for p in range(100)]  # 2 blocks each
    for p, tokens in enumerate(prompts):
        store_prompt(index, tokens, [p * 10, p * 10 + 1])
    status = index.status(W)
    assert status is not None and status.blocks <= 64
    assert status.evicted == 200 - status.blocks
    assert index.cached_blocks(W, prompts[-1]) == 2  # the newest are kept
    assert index.cached_blocks(W, prompts[0]) == 0  # the oldest went first
    index.remove(W, [990, 991])  # removing after eviction keeps the counts right
    assert index.cached_blocks(W, prompts[-1]) == 0


def test_a_cap_below_one_eviction_step_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        KvIndex(max_blocks_per_worker=4)


def test_forget_drops_the_worker() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    index.forget(W)
    assert index.cached_blocks(W, PROMPT) is None and index.worker_ids() == []


def test_a_suspended_worker_keeps_its_blocks_untrusted_until_a_replay_resumes() -> None:
    index = ready_index()
    store_prompt(index, PROMPT, [1, 2, 3, 4])
    index.suspend(W)  # connection lost; a replay will tell whether the engine is the same
    index.suspend(W)  # said twice (the monitor, then the session ending): one hole
    assert index.is_suspended(W) and index.cached_blocks(W, PROMPT) is None
    assert index.status(W).blocks == 4  # type: ignore[union-attr]
    index.begin_replay(W, 1)  # the same engine: resume after the last batch applied
    assert index.check_sequence(W, 1) is SeqVerdict.APPLY
    index.mark_replayed(W, complete=True)
    assert not index.is_suspended(W) and index.cached_blocks(W, PROMPT) == 4
