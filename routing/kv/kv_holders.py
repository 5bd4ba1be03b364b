"""Which workers hold each block: one map for all of routing.kv.kv_index's workers.

Each block key (routing.kv.kv_index's chain) maps to a bitmask of the workers holding it, each
worker having a bit of its own. So a policy scoring N workers walks the prompt's chain once
(:meth:`Holders.walk`) with one dict lookup per block for all of them, hashing each block
only when it comes to it and stopping at the first block that no worker still matching
holds; most prompts share only a prefix with what is cached. NVIDIA Dynamo's KV router
walks its radix tree of blocks to sets of workers the same way.

Emptying a worker (a clear, a restart, a lost stream) must not walk its blocks at once
(half a second for 500,000 blocks, on the router's loop): it takes a fresh bit, which no
entry carries yet, and its old bit is swept from the map :data:`SWEEP_STEP` keys per event
after (:meth:`Holders.sweep`), then reused. Lookups only ever ask for the bits of the
workers indexed now, so a bit being swept is never read as a hit.

A single bit is stored as the worker's own int object, not a copy: the map costs what a
per-worker set would (bench/kv_index/run.py measures the bytes per block).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

SWEEP_STEP = 256  # keys of emptied workers cleared per event while any are left


def blocks(token_ids: Iterable[int], block_size: int) -> Iterator[tuple[int, ...]]:
    """Each full block's token ids as a tuple, lazily: zip cuts them in C, dropping the
    partial last block (a third cheaper than slicing a tuple in a loop)."""
    return zip(*[iter(token_ids)] * block_size, strict=False)


class Holders:
    """Block key -> the bits of the workers holding it, and which worker has which bit."""

    def __init__(self) -> None:
        self.map: dict[int, int] = {}
        self.owner: dict[int, int] = {}  # a worker's bit -> its id
        # Bits of emptied workers still in the map, with the keys left to sweep.
        self.dead: list[tuple[int, Iterator[int]]] = []

    def add_worker(self, worker_id: int) -> int:
        """A bit for a new worker: the lowest neither a worker's nor being swept."""
        used = sum(self.owner) + sum(bit for bit, _ in self.dead)  # distinct bits
        bit = ~used & (used + 1)
        self.owner[bit] = worker_id
        return bit

    def drop_worker(self, bit: int) -> None:
        del self.owner[bit]
        if not self.owner:
            self.clear()  # nobody left: nothing to sweep

    def retire(self, bit: int, keys: Iterable[int]) -> int:
        """The worker of `bit` dropped the blocks `keys` (its by_vllm values, no longer
        mutated): they are swept later, and its new bit is returned."""
        self.dead.append((bit, iter(keys)))
        worker_id = self.owner.pop(bit)
        return self.add_worker(worker_id)

    def clear(self) -> None:
        self.map.clear()
        self.dead.clear()

    def unhold(self, bit: int, key: int) -> None:
        left = self.map[key] & ~bit
        if left:
            self.map[key] = left
        else:
            del self.map[key]

    def sweep(self, budget: int = SWEEP_STEP) -> None:
        """Clear up to `budget` keys of emptied workers; a bit fully swept is free again."""
        while self.dead and budget > 0:
            bit, keys = self.dead[-1]
            swept = 0
            for key in itertools.islice(keys, budget):
                swept += 1
                if self.map.get(key, 0) & bit:  # else a repeated key, already swept
                    self.unhold(bit, key)
            if swept < budget:
                self.dead.pop()
            budget -= swept

    def walk(
        self,
        mask: int,
        token_ids: Sequence[int],
        seed: int,
        size: int,
        next_keys: dict[int, int] | None = None,
    ) -> list[tuple[int, int]]:
        """(worker id, leading blocks held) of each worker in `mask`, from the chain of
        `token_ids` seeded with `seed`. A block is hashed only while some worker still
        matches: a prompt's tail that nobody holds costs nothing. With `next_keys`, each
        worker's first block not held is given by its key (kv_aware's pending credit goes
        on from there), absent when it holds every full block."""
        get = self.map.get
        key, active = seed, mask
        depths: list[tuple[int, int]] = []
        for depth, block in enumerate(blocks(token_ids, size)):
            key = hash((key, block))
            held = get(key, 0) & active
            if held != active:
                ended = len(depths)
                self._split(active ^ held, depth, depths)  # their prefixes end here
                if next_keys is not None:
                    for worker_id, _ in depths[ended:]:
                        next_keys[worker_id] = key
                active = held
                if not active:
                    return depths
        self._split(active, len(token_ids) // size, depths)
        return depths

    def leading(self, bit: int, chain: Sequence[int]) -> int:
        """How many leading keys of `chain` the worker of `bit` holds."""
        get = self.map.get
        for matched, key in enumerate(chain):
            if not get(key, 0) & bit:
                return matched
        return len(chain)

    def _split(self, bits: int, depth: int, into: list[tuple[int, int]]) -> None:
        """Append (worker id, depth) for each bit set in `bits`."""
        while bits:
            low = bits & -bits
            into.append((self.owner[low], depth))
            bits ^= low
