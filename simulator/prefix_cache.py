"""The simulated engine's prefix cache: physical KV blocks in an LRU, chained like vLLM's.

Block *i*'s hash chains block *i-1*'s hash with the block's token ids and, for a LoRA, the
adapter's name (vLLM's ``extra_keys``): a block only matches when the whole prefix up to it
matches, a LoRA never shares the base model's blocks, and the same tokens get the same hash on
every simulated engine, whatever its model name, as they do on every vLLM server. The hashes
are 64-bit ints from sha256, as vLLM's with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (the
values differ from vLLM's: its seed, ``NONE_HASH``, is its own).

What vLLM 0.32 does, and so does this model (seen in shared/vllm-captures):

* A request reuses at most ``(n - 1) // block_size`` leading cached blocks: the prompt's last
  token is always computed, for its logits. Only full blocks are cached.
* Every full block a request computes is stored, in one ``BlockStored`` per request and step
  (its parent the block before): the prompt's after prefill, then each block that decoding
  fills (prompt tail plus generated tokens), as it fills.
* No de-duplication: a block computed again while an identical one is still cached (the
  prompt's last block, two identical prompts at once, the same answer generated twice) is a
  second physical block, stored again under the same hash.
* Room is made before storing, least recently used first, with one ``BlockRemoved`` per
  physical block (one hash each). ``AllBlocksCleared`` on a reset.

The model's simplification: ``capacity`` bounds the cached blocks only; the blocks running
requests hold are counted apart (``vllm:kv_cache_usage_perc``) and never protect a block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from itertools import count
from typing import Any

from simulator.kv_publisher import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

__all__ = ["PrefixCache", "block_hash"]


def block_hash(parent: int | None, tokens: Sequence[int], lora: str | None) -> int:
    """A full block's hash: its parent's, its token ids and its LoRA, as 64 bits of sha256.
    repr() is exact for ints of any size and the same in every process (hash() is not)."""
    key = repr((parent, tuple(tokens), lora)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


class PrefixCache:
    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._lru: OrderedDict[int, int] = OrderedDict()  # physical id -> hash, oldest first
        self._by_hash: dict[int, list[int]] = {}  # hash -> its physical blocks, oldest first
        self._ids = count()
        self._lora_ids: dict[str, int] = {}  # vLLM numbers adapters from 1 as it loads them

    def __len__(self) -> int:
        """Distinct hashes cached: what an index built from the events can know."""
        return len(self._by_hash)

    @property
    def physical_blocks(self) -> int:
        """Blocks cached, two with the same hash counting twice (as vLLM holds them)."""
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._by_hash

    def clear(self) -> list[Any]:
        self._lru.clear()
        self._by_hash.clear()
        return [AllBlocksCleared()]

    def hashes(self, parent: int | None, tokens: Sequence[int], lora: str | None) -> list[int]:
        """The chained hashes of the full blocks of `tokens`, after `parent`."""
        bs, out = self.block_size, []
        for i in range(len(tokens) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], lora)
            out.append(parent)
        return out

    def prefill(self, lora: str | None, tokens: Sequence[int]) -> tuple[int, list[int], list[Any]]:
        """Count the leading cached blocks a prompt reuses, refresh them, then store the
        prompt's other full blocks. Returns (hits, every full block's hash, events)."""
        hashes = self.hashes(None, tokens, lora)
        reusable = max(len(tokens) - 1, 0) // self.block_size
        hits = 0
        while hits < min(reusable, len(hashes)) and hashes[hits] in self._by_hash:
            # vLLM takes the first cached block of a hash; reusing it makes it recent.
            self._lru.move_to_end(self._by_hash[hashes[hits]][0])
            hits += 1
        events = self.store(lora, tokens, hashes, hits)
        return hits, hashes, events

    def store(
        self, lora: str | None, tokens: Sequence[int], hashes: Sequence[int], first: int
    ) -> list[Any]:
        """Store blocks ``first..len(hashes)-1`` of a request (`tokens` covers them all) as
        new physical blocks, making room first. Returns the events, removals first."""
        new = list(hashes[first:])
        if not new:
            return []
        events: list[Any] = self._make_room(len(new))
        for h in new:
            block = next(self._ids)
            self._lru[block] = h
            self._by_hash.setdefault(h, []).append(block)
        bs = self.block_size
        events.append(
            BlockStored(
                block_hashes=list[BlockHash](new),
                parent_block_hash=hashes[first - 1] if first else None,
                token_ids=list(tokens[first * bs : len(hashes) * bs]),
                block_size=bs,
                lora_id=self._lora_id(lora) if lora else None,
                medium="GPU",
                lora_name=lora,
                extra_keys=[(lora,) if lora else None for _ in new],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        return events

    def _make_room(self, n: int) -> list[Any]:
        events: list[Any] = []
        while self._lru and len(self._lru) + n > self.capacity:
            block, h = self._lru.popitem(last=False)
            same = self._by_hash[h]
            same.remove(block)
            if not same:
                del self._by_hash[h]
            events.append(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0))
        return events

    def _lora_id(self, name: str) -> int:
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
