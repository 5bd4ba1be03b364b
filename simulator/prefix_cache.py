"""The simulated engine's prefix cache: an LRU of full blocks, chained like vLLM's.

Block *i*'s hash chains block *i-1*'s hash with the block's token ids, seeded by the
requested model name (so a LoRA adapter never shares the base model's blocks): a block
only matches when the whole prefix up to it matches. Only full blocks are cached, and, as in
vLLM, a request reuses at most ``(n - 1) // block_size`` of them (the last prompt token is
always computed).

Every change is also described as vLLM's KV cache events (simulator.kv_publisher):
a ``BlockStored`` per run of newly stored consecutive blocks (its parent the block before
the run, its token ids the run's), a ``BlockRemoved`` for the blocks evicted to make room,
and ``AllBlocksCleared`` on a reset. The hashes are opaque 64-bit numbers, as vLLM's are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from simulator.kv_publisher import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

Run = tuple[int | None, list[BlockHash], int]  # (parent, new hashes, index of the first)
_MASK64 = (1 << 64) - 1


class PrefixCache:
    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._lora_ids: dict[str, int] = {}  # vLLM numbers adapters from 1 as it loads them

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> list[Any]:
        self._blocks.clear()
        return [AllBlocksCleared()]

    def lookup_and_store(
        self, seed: str, lora: bool, token_ids: Sequence[int]
    ) -> tuple[int, list[Any]]:
        """Count the leading cached full blocks, then cache (or refresh) every full block.
        Returns the hits and the events describing what changed."""
        bs = self.block_size
        blocks = self._blocks
        tokens = tuple(token_ids)
        h = hash(seed) & _MASK64
        # vLLM always computes the prompt's last token (for its logits), so a request reuses
        # at most the full blocks before it; all its full blocks are cached afterwards.
        reusable = max(len(tokens) - 1, 0) // bs
        hits, parent, previous_new = 0, None, False
        runs: list[Run] = []
        for i in range(len(tokens) // bs):
            h = hash((h, tokens[i * bs : (i + 1) * bs])) & _MASK64
            new = h not in blocks
            if new:
                blocks[h] = None
                if previous_new:
                    runs[-1][1].append(h)  # the run goes on: same parent, one block more
                else:
                    runs.append((parent, [h], i))
            else:
                if hits == i and i < reusable:
                    hits += 1
                blocks.move_to_end(h)
            parent, previous_new = h, new
        events: list[Any] = [self._stored(run, tokens, seed, lora) for run in runs]
        evicted: list[BlockHash] = [
            blocks.popitem(last=False)[0] for _ in range(len(blocks) - self.capacity)
        ]
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium="GPU"))
        return hits, events

    def _stored(self, run: Run, tokens: tuple[int, ...], seed: str, lora: bool) -> BlockStored:
        parent, hashes, first = run
        bs = self.block_size
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(tokens[first * bs : (first + len(hashes)) * bs]),
            block_size=bs,
            lora_id=self._lora_id(seed) if lora else None,
            medium="GPU",
            lora_name=seed if lora else None,
        )

    def _lora_id(self, name: str) -> int:
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
