"""The index's shared walk (routing.kv.kv_holders: one map for all workers) against truth.

The truth for a worker is its own map of vLLM's hashes to the index's keys (what
``BlockRemoved`` and eviction act on): a worker holds a key iff one of its vLLM blocks
carries it. Random stores, removals, clears, restarts, gaps, forgets and evictions, with
prompts sharing prefixes, two block sizes and a LoRA adapter, must leave the shared walk
(`cached_blocks_all`), the single-worker lookups and that truth in agreement.
"""

from __future__ import annotations

import random

import pytest

from routing.kv.kv_index import KvIndex, LoraKey, chain_hashes

WORKERS = list(range(10, 22))  # 12 workers: bits past 8 are not small ints
STEMS = [[random.Random(s).randrange(50) for _ in range(64)] for s in range(3)]


def prompt(rng: random.Random) -> list[int]:
    """A shared stem's prefix, then a tail of its own: most prompts share only a prefix."""
    stem = rng.choice(STEMS)[: rng.randrange(0, 65)]
    return stem + [rng.randrange(50) for _ in range(rng.randrange(0, 24))]


def truth(index: KvIndex, worker_id: int, tokens: list[int], lora: LoraKey) -> int | None:
    """Leading blocks held, from the worker's own vLLM map alone (no shared structure)."""
    entry = index._workers.get(worker_id)
    if entry is None or not index.is_known(worker_id):
        return None
    if entry.block_size is None:
        return 0
    held = set(entry.by_vllm.values())
    chain = chain_hashes(tokens, lora, entry.block_size)
    return next((i for i, key in enumerate(chain) if key not in held), len(chain))


def step(index: KvIndex, rng: random.Random, seqs: dict[int, int], hashes: list[int]) -> None:
    """One random event on a random worker, as the subscriber would apply it."""
    worker = rng.choice(WORKERS)
    kind = rng.random()
    if kind < 0.02:
        index.forget(worker)
        seqs.pop(worker, None)
        return
    seq = seqs.get(worker, -1) + 1
    if kind < 0.05:
        seq = 0 if rng.random() < 0.5 else seq + 1  # a restart, or a gap
    seqs[worker] = seq
    index.check_sequence(worker, seq)
    if kind < 0.08:
        index.clear(worker)
    elif kind < 0.35 and hashes:
        index.remove(worker, rng.sample(hashes, min(len(hashes), rng.randrange(1, 6))))
    else:
        store(index, rng, worker, hashes)


def store(index: KvIndex, rng: random.Random, worker: int, hashes: list[int]) -> None:
    """A whole prompt stored from its first block, under fresh vLLM hashes (so the same
    tokens may be stored twice under two hashes), sometimes at a worker's other size."""
    size = 8 if worker % 3 == 0 else 4
    size = 16 if rng.random() < 0.01 else size  # a reconfigured engine
    lora = "adapter" if rng.random() < 0.2 else None
    tokens = prompt(rng)
    new = [rng.getrandbits(40) for _ in range(len(tokens) // size)]
    hashes.extend(new)
    if new:
        index.store(worker, new, None, tokens, size, lora)


def check(index: KvIndex, rng: random.Random) -> None:
    for lora in (None, "adapter"):
        tokens = prompt(rng)
        found = index.cached_blocks_all(WORKERS, tokens, lora, 4)
        for worker in WORKERS:
            expected = truth(index, worker, tokens, lora)
            one = index.cached_blocks(worker, tokens, lora)
            size = index.block_size(worker) or 4
            assert one == expected
            assert found.get(worker) == (None if expected is None else (expected, size))
            chain = chain_hashes(tokens, lora, size)
            assert index.cached_blocks_in_chain(worker, chain, size) == expected


def assert_holders_match(index: KvIndex) -> None:
    """The shared map's live bits are exactly each worker's keys; once no emptied worker is
    left to sweep, nothing stale is left either (memory)."""
    expected: dict[int, int] = {}
    live = 0
    for entry in index._workers.values():
        live |= entry.bit
        for key in set(entry.by_vllm.values()):
            expected[key] = expected.get(key, 0) | entry.bit
    seen = {key: held & live for key, held in index._holders.map.items() if held & live}
    assert seen == expected
    dead = sum(bit for bit, _ in index._holders.dead)
    assert not dead & live, "a bit being swept was given to a worker"
    if not index._holders.dead:
        assert index._holders.map == expected


@pytest.mark.parametrize("seed", range(6))
def test_the_shared_walk_agrees_with_each_workers_own_blocks(seed: int) -> None:
    rng = random.Random(seed)
    index = KvIndex(max_blocks_per_worker=64)  # small: eviction happens
    seqs: dict[int, int] = {}
    hashes: list[int] = []
    for i in range(1500):
        step(index, rng, seqs, hashes)
        if i % 25 == 0:
            check(index, rng)
            assert_holders_match(index)
    check(index, rng)
    assert_holders_match(index)
    assert sum(s.evicted for w in WORKERS if (s := index.status(w))) > 0
    while index._holders.dead:  # events go on: the sweep finishes
        step(index, rng, seqs, hashes)
    assert_holders_match(index)
    for worker in WORKERS:
        index.forget(worker)
    assert index._holders.map == {} and index._holders.owner == {}


def test_workers_get_distinct_bits_and_a_forgotten_bit_is_reused() -> None:
    index = KvIndex()
    for worker in (5, 6, 7):
        index.check_sequence(worker, 0)
    bits = [index._workers[w].bit for w in (5, 6, 7)]
    assert bits == [1, 2, 4]
    index.forget(6)
    index.check_sequence(9, 0)
    assert index._workers[9].bit == 2


def test_the_walk_stops_at_the_first_block_nobody_holds() -> None:
    """A long tail nobody holds is not hashed: the walk ends at the first miss."""
    index = KvIndex()
    index.check_sequence(1, 0)
    index.store(1, [1, 2], None, list(range(8)), 4, None)

    class Tail(list[int]):
        """Token ids whose 13th onwards must never be read."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            for i, token in enumerate(super().__iter__()):
                assert i < 12, "read past the first block nobody holds"
                yield token

    tokens = Tail([*range(8), *range(100, 200)])
    assert index.cached_blocks_all([1], tokens, None, 4) == {1: (2, 4)}


def test_emptying_a_large_worker_is_swept_over_later_events() -> None:
    """A clear does not walk the worker's blocks at once: its old bit is swept a step per
    event, never seen by a lookup meanwhile, and reused once swept."""
    index = KvIndex()
    for worker in (1, 2):
        index.check_sequence(worker, 0)
    ids = list(range(4 * 2000))
    index.store(1, list(range(2000)), None, ids, 4, None)
    index.store(2, [9000], None, ids[:4], 4, None)
    old_bit = index._workers[1].bit
    index.clear(1)
    assert index.cached_blocks_all([1, 2], ids, None, 4) == {1: (0, 4), 2: (1, 4)}
    assert index._workers[1].bit != old_bit and len(index._holders.map) == 2000
    index.store(1, [1], None, ids[:4], 4, None)  # the same first block, under the new bit
    assert index.cached_blocks_all([1, 2], ids, None, 4) == {1: (1, 4), 2: (1, 4)}
    events = 0
    while index._holders.dead:
        index.remove(2, [123])  # any event sweeps a step
        events += 1
    assert events + 1 == -(-2000 // 256)  # the store swept a step too
    assert len(index._holders.map) == 1
    index.check_sequence(3, 0)
    assert index._workers[3].bit == old_bit  # free again
