"""simulator.prefix_cache beyond what test_simulator_wire checks: LRU order, a chain that
breaks at the first different block, LoRA separation, stores that extend a request."""

from __future__ import annotations

from simulator.kv_publisher import AllBlocksCleared, BlockRemoved, BlockStored
from simulator.prefix_cache import PrefixCache, block_hash


def prompt(start: int, blocks: int, size: int = 4) -> list[int]:
    return [*range(start, start + blocks * size), 9999]  # a partial block at the end


def test_a_changed_block_breaks_the_chain_from_there_on() -> None:
    cache = PrefixCache(capacity=64, block_size=4)
    first = prompt(0, 3)
    cache.prefill(None, first)
    changed = [*first[:4], 777, *first[5:]]  # the second block differs
    hits, hashes, _ = cache.prefill(None, changed)
    assert hits == 1
    # The third block holds the same tokens but another parent: another hash.
    assert hashes[2] != cache.hashes(None, first, None)[2]
    assert hashes[0] == block_hash(None, first[:4], None)


def test_the_least_recently_used_block_is_evicted_first() -> None:
    cache = PrefixCache(capacity=4, block_size=4)
    a, b = prompt(0, 2), prompt(100, 2)
    _, a_hashes, _ = cache.prefill(None, a)
    cache.prefill(None, b)
    assert cache.prefill(None, a)[0] == 2  # a's blocks become the most recent
    _, _, events = cache.prefill(None, prompt(200, 2))  # room for 2: b's go
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 2 and not set(removed) & set(a_hashes)
    assert cache.prefill(None, a)[0] == 2 and cache.prefill(None, b)[0] == 0


def test_a_lora_never_shares_the_base_models_blocks_and_gets_an_id() -> None:
    cache = PrefixCache(capacity=64, block_size=4)
    tokens = prompt(0, 2)
    cache.prefill(None, tokens)
    hits, _, events = cache.prefill("sql", tokens)
    assert hits == 0
    [stored] = events
    assert isinstance(stored, BlockStored)
    assert (stored.lora_id, stored.lora_name, stored.extra_keys) == (1, "sql", [("sql",)] * 2)
    assert cache.prefill("sql", tokens)[0] == 2
    [other] = cache.prefill("chat", tokens)[2]
    assert other.lora_id == 2


def test_store_extends_a_request_with_its_decoded_blocks_and_clear_empties() -> None:
    cache = PrefixCache(capacity=64, block_size=4)
    tokens = list(range(12))
    _, hashes, _ = cache.prefill(None, tokens[:8])
    more = hashes + cache.hashes(hashes[-1], tokens[8:12], None)
    [stored] = cache.store(None, tokens, more, len(hashes))
    assert stored.parent_block_hash == hashes[-1] and stored.token_ids == tokens[8:12]
    assert more[2] in cache and len(cache) == 3
    assert cache.store(None, tokens, more, len(more)) == []
    assert cache.clear() == [AllBlocksCleared()] and len(cache) == 0
    assert cache.physical_blocks == 0
