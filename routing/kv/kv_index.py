"""An exact index of the KV cache blocks each worker holds, built from vLLM's own KV events.

**Identity of a block.** vLLM names a full block by a hash of its parent's hash, its tokens
and extra keys (LoRA, multimodal inputs, a cache salt), with a hash function and a seed the
router does not share. So the index names blocks by a chain of its own: block *i* of a
prompt is ``hash((key of block i-1, its block_size token ids))``, seeded by the LoRA
adapter, and a request's token ids are looked up without vLLM's hash. vLLM's hashes are
kept only as a map to ours, to apply ``BlockRemoved`` and to find a stored block's parent.
The chain is Python's tuple hash: 64 bits, fast (C), the same within a process; it is not
meant to resist a client crafting collisions, which could only misplace that client's
own requests.

**One map for all workers.** Which workers hold each key is one map of bitmasks
(routing.kv.kv_holders), so :meth:`KvIndex.cached_blocks_all` walks a prompt's chain once for
all workers, as far as any holds it. A worker holding the same key under several of vLLM's
hashes counts its extra copies apart, so its bit is cleared only with the last of them.

**What a lookup answers.** :meth:`KvIndex.cached_blocks` counts the leading full blocks of
the token ids the worker holds, stopping at the first it does not, as vLLM's prefix lookup
does (vLLM then recomputes the last prompt token, so a fully cached prompt reuses one token
less: the caller's concern). ``None`` means "do not trust this index": the worker has no
events, or its stream had a gap not yet repaired, or it is being rebuilt. Never a stale
answer: a gap (a sequence number skipped) marks the worker unknown until a replay fills
it, an ``AllBlocksCleared`` or an engine restart (sequence numbers start again at 0)
empties it, and a lost connection empties it (the engine may have restarted meanwhile).

**LoRA.** Blocks of an adapter chain from a seed of its own, so they never match the base
model's or another adapter's. The key is the adapter's name when the event carries
``lora_name`` (vLLM since 2025; the name clients send as ``model``), else ``lora_id`` (an
int vLLM assigns per engine, which the router cannot know: older engines' adapter blocks
then never match a name, an under-estimate, never a false hit).

**Memory.** Each worker holds at most ``max_blocks_per_worker`` blocks (vLLM keeps tens of
thousands per GPU). Past the cap the oldest stored sixteenth is dropped at once (one
cheap pass, amortised), which can only hide blocks, never invent them. ``bench/kv_index/run.py``
measures the bytes per block.

Everything here runs on the router's event loop: the subscriber (routing.kv.kv_subscriber)
writes, the policies read, both without locks and without I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from routing.kv.kv_holders import Holders, blocks

BlockHash = int | bytes  # vLLM's, opaque: an int or bytes by version and hash algorithm
LoraKey = str | int | None  # an adapter's name (or vLLM's lora_id); None: the base model

DEFAULT_MAX_BLOCKS_PER_WORKER = 500_000
_EVICT_SHARE = 16  # past the cap, drop 1/16 of it in one pass


def chain_hashes(token_ids: Sequence[int], lora: LoraKey, block_size: int) -> list[int]:
    """The index's key of each full block of `token_ids`, in order (a partial last block
    is never cached, by vLLM either). :meth:`KvIndex.cached_blocks_all` makes them lazily
    instead, as far as some worker matches."""
    key = chain_seed(lora)
    keys = []
    for block in blocks(token_ids, block_size):
        key = hash((key, block))
        keys.append(key)
    return keys


def chain_seed(lora: LoraKey) -> int:
    """The key a chain starts from: the base model's, or an adapter's own."""
    return 0 if lora is None else hash(("lora", lora))


class Trust(StrEnum):
    """Whether a worker's index may be used."""

    READY = "ready"  # every event since an empty cache was applied
    UNKNOWN = "unknown"  # a gap, a lost stream or no history: answers None


class SeqVerdict(StrEnum):
    """What a batch's sequence number meant (see :meth:`KvIndex.check_sequence`)."""

    APPLY = "apply"  # the next one: apply it
    DUPLICATE = "duplicate"  # already applied (replay overlap): skip it
    GAP = "gap"  # some were missed: the worker is unknown until repaired; apply it anyway
    RESTART = "restart"  # the engine restarted: emptied; apply it


@dataclass(slots=True)
class WorkerBlocks:
    """One worker's cached blocks and where its event stream stands."""

    # This worker's bit in the holders map (routing.kv.kv_holders; changes when it empties).
    bit: int
    # vLLM's hash -> the index's key; insertion order is the eviction order.
    by_vllm: dict[BlockHash, int] = field(default_factory=dict)
    # The index's key -> how many more of vLLM's blocks carry it beyond the first (extra
    # keys such as a cache salt give vLLM several hashes for the same tokens); rare.
    extra: dict[int, int] = field(default_factory=dict)
    # vLLM's hash -> how many more physical blocks carry it beyond the first: vLLM does not
    # de-duplicate a block recomputed while a copy is cached, and evicts each one apart.
    copies: dict[BlockHash, int] = field(default_factory=dict)
    block_size: int | None = None
    trust: Trust = Trust.UNKNOWN
    next_seq: int | None = None  # the sequence number expected next; None: none seen
    catching_up: bool = False  # after a replay: lower numbers are duplicates, not a restart
    # Gaps (and undecodable batches) not repaired since the cache was last known empty:
    # the index is trusted only at 0.
    holes: int = 0
    suspended: bool = False  # the connection dropped; blocks kept until a replay verifies
    # KV cache groups that are not full attention (hybrid models), learned from their
    # stores: their removals are ignored (routing.kv.kv_events). Kept across restarts.
    skipped_groups: set[int] = field(default_factory=set)
    gaps: int = 0
    restarts: int = 0
    clears: int = 0
    orphans: int = 0  # stored blocks whose parent the index did not have: skipped
    evicted: int = 0  # dropped for the memory cap


@dataclass(frozen=True, slots=True)
class IndexStatus:
    """One worker's index, for /metrics and the worker listing."""

    trust: str
    blocks: int
    block_size: int | None
    next_seq: int | None
    gaps: int
    restarts: int
    clears: int
    orphans: int
    evicted: int


class KvIndex:
    """Every worker's cached blocks, by worker id (the registry's, as in WorkerView.id)."""

    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        if max_blocks_per_worker < _EVICT_SHARE:
            raise ValueError(f"max_blocks_per_worker must be at least {_EVICT_SHARE}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self._workers: dict[int, WorkerBlocks] = {}
        self._holders = Holders()  # the index's key -> the bits of the workers holding it

    # -- the policy's side (read only) ------------------------------------------------------

    def cached_blocks(
        self,
        worker_id: int,
        token_ids: Sequence[int],
        lora: LoraKey = None,
        block_size: int | None = None,
    ) -> int | None:
        """How many leading full blocks of `token_ids` the worker holds, or None when that is
        unknown (no events from it, or its index is not trusted now).

        `lora`: the adapter's name when the request is for a LoRA adapter, else None.
        `block_size`: None takes the worker's own, from its events; a different one than
        the worker's answers None (its blocks cannot be compared).
        For many workers, :meth:`cached_blocks_all` walks the chain once for all."""
        entry = self._trusted(worker_id)
        if entry is None or entry.block_size is None:
            return None if entry is None else 0
        size = entry.block_size if block_size is None else block_size
        if size != entry.block_size:
            return None
        return self._holders.walk(entry.bit, token_ids, chain_seed(lora), size)[0][1]

    def cached_blocks_all(
        self,
        worker_ids: Iterable[int],
        token_ids: Sequence[int],
        lora: LoraKey,
        block_size: int | None = None,
        next_keys: dict[int, int] | None = None,
    ) -> dict[int, tuple[int, int | None]]:
        """:meth:`cached_blocks` of every trusted worker among `worker_ids`, each in its own
        block size, as ``{worker id: (blocks, block size)}``; the untrusted are left out.
        A trusted worker with nothing stored yet holds 0 blocks of `block_size` (None: its
        size is not known from its events). One walk of the prompt's chain per block size,
        for all its workers at once. With `next_keys`, the chain key of the first block each
        worker does not hold, in its own size (Holders.walk)."""
        found: dict[int, tuple[int, int | None]] = {}
        masks: dict[int, int] = {}  # block size -> the bits of its trusted workers
        for worker_id in worker_ids:
            entry = self._trusted(worker_id)
            if entry is None:
                continue
            if entry.block_size is None:
                found[worker_id] = (0, block_size)
            else:
                masks[entry.block_size] = masks.get(entry.block_size, 0) | entry.bit
        seed = chain_seed(lora)
        for size, mask in masks.items():
            for held_by, count in self._holders.walk(mask, token_ids, seed, size, next_keys):
                found[held_by] = (count, size)
        return found

    def cached_blocks_in_chain(
        self, worker_id: int, chain: Sequence[int], block_size: int
    ) -> int | None:
        """:meth:`cached_blocks` for a chain already computed with `block_size`."""
        entry = self._trusted(worker_id)
        if entry is None:
            return None
        if entry.block_size is None:
            return 0  # trusted and nothing stored yet: an empty cache
        if entry.block_size != block_size:
            return None
        return self._holders.leading(entry.bit, chain)

    def block_size(self, worker_id: int) -> int | None:
        """The worker's block size as its events state it (None: none stored yet)."""
        entry = self._workers.get(worker_id)
        return None if entry is None else entry.block_size

    def is_known(self, worker_id: int) -> bool:
        return self._trusted(worker_id) is not None

    def _trusted(self, worker_id: int) -> WorkerBlocks | None:
        entry = self._workers.get(worker_id)
        return entry if entry is not None and entry.trust is Trust.READY else None

    # -- the subscriber's side -----------------------------------------------------------

    def check_sequence(self, worker_id: int, seq: int) -> SeqVerdict:
        """Place a batch's sequence number in the worker's stream before it is applied.
        A gap makes the worker unknown (a replay may repair it: :meth:`mark_replayed`); a
        number going backwards means the engine restarted, so the index is emptied."""
        entry = self._entry(worker_id)
        expected = entry.next_seq
        restarted = False
        if expected is not None and seq < expected:
            if entry.catching_up:
                return SeqVerdict.DUPLICATE
            entry.restarts += 1
            self._reset(entry)
            expected, restarted = None, True
        entry.catching_up = False
        entry.next_seq = seq + 1
        if expected is None:
            if seq == 0:
                entry.trust = Trust.READY  # an engine's first batch: its cache was empty
                return SeqVerdict.RESTART if restarted else SeqVerdict.APPLY
            entry.trust = Trust.UNKNOWN  # joined mid-stream: what came before is unseen
            entry.holes += 1
            return SeqVerdict.GAP
        if seq == expected:
            return SeqVerdict.APPLY
        entry.gaps += 1
        entry.holes += 1
        entry.trust = Trust.UNKNOWN
        return SeqVerdict.GAP

    def expected_seq(self, worker_id: int) -> int | None:
        """The sequence number the worker's stream should send next (None: none seen)."""
        entry = self._workers.get(worker_id)
        return None if entry is None else entry.next_seq

    def begin_replay(self, worker_id: int, start: int) -> None:
        """A replay from `start` follows. From 0 the index is rebuilt from nothing; from a
        later number it keeps its blocks and resumes there, still unknown until
        :meth:`mark_replayed` says the replay left no gap."""
        entry = self._entry(worker_id)
        if start == 0:
            self._reset(entry)
        else:
            entry.trust = Trust.UNKNOWN
            entry.next_seq = start
            entry.catching_up = False
            entry.suspended = False

    def mark_replayed(self, worker_id: int, *, complete: bool) -> None:
        """A replay ended. `complete`: it left no gap, so the index is whole again. Either
        way, batches numbered below the next expected one are duplicates from now on (the
        live socket kept queueing while the replay ran), not an engine restart."""
        entry = self._entry(worker_id)
        entry.catching_up = True
        if not complete:
            entry.holes = max(entry.holes, 1)  # cut short: what it did not resend is lost
        elif entry.holes:
            entry.holes -= 1  # the gap it was asked for
        if entry.holes == 0 and entry.next_seq is not None:
            entry.trust = Trust.READY

    def mark_empty(self, worker_id: int, next_seq: int = 0) -> None:
        """The engine has published nothing before `next_seq` (a replay came back empty):
        its cache is empty and the index is trusted from there."""
        entry = self._entry(worker_id)
        self._reset(entry)
        entry.next_seq = next_seq
        entry.trust = Trust.READY

    def mark_unknown(self, worker_id: int) -> None:
        """Events were lost (a batch that could not be decoded): untrusted until the cache
        is emptied (a restart or a clear), since a replay would resend the same bytes."""
        entry = self._entry(worker_id)
        entry.holes += 1
        entry.trust = Trust.UNKNOWN

    def lose_stream(self, worker_id: int) -> None:
        """The connection dropped: whatever happened meanwhile (a restart too) is unseen."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            self._reset(entry)

    def suspend(self, worker_id: int) -> None:
        """The connection dropped, and a replay can tell later whether the same engine is
        still there: keep the blocks, untrusted, until :meth:`begin_replay` resumes (the
        replay then fills what was missed) or starts over."""
        entry = self._workers.get(worker_id)
        if entry is not None and not entry.suspended:
            entry.suspended = True
            entry.holes += 1
            entry.trust = Trust.UNKNOWN

    def is_suspended(self, worker_id: int) -> bool:
        entry = self._workers.get(worker_id)
        return entry is not None and entry.suspended

    def skip_group(self, worker_id: int, group: int) -> None:
        self._entry(worker_id).skipped_groups.add(group)

    def skips_group(self, worker_id: int, group: int | None) -> bool:
        entry = self._workers.get(worker_id)
        return group is not None and entry is not None and group in entry.skipped_groups

    def forget(self, worker_id: int) -> None:
        """The worker left the fleet (or its endpoint changed): its bit is free again."""
        entry = self._workers.pop(worker_id, None)
        if entry is not None:
            self._empty(entry)
            self._holders.drop_worker(entry.bit)

    def worker_ids(self) -> list[int]:
        return list(self._workers)

    def store(
        self,
        worker_id: int,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: LoraKey,
    ) -> None:
        """BlockStored: consecutive full blocks, the first chained to `parent`."""
        entry = self._entry(worker_id)
        if self._holders.dead:
            self._holders.sweep()
        if block_size <= 0 or len(token_ids) < len(block_hashes) * block_size:
            raise ValueError("BlockStored has fewer token ids than its blocks need")
        if entry.block_size != block_size:
            if entry.by_vllm:
                self._reset(entry)  # a reconfigured engine: its old blocks cannot match
            entry.block_size = block_size
        if parent is None:
            key = chain_seed(lora)
        elif (found := entry.by_vllm.get(parent)) is not None:
            key = found
        else:
            entry.orphans += len(block_hashes)
            return
        # Sliced, not cut by _blocks: most events hold one block, where zip's setup costs more.
        tokens = tuple(token_ids)
        by_vllm, holders, bit, extra = entry.by_vllm, self._holders.map, entry.bit, entry.extra
        for i, block_hash in enumerate(block_hashes):
            key = hash((key, tokens[i * block_size : (i + 1) * block_size]))
            if block_hash in by_vllm:
                # vLLM stores a recomputed block again under the same hash (a second
                # physical block) and removes each physical block apart: count the copies.
                entry.copies[block_hash] = entry.copies.get(block_hash, 0) + 1
                continue
            by_vllm[block_hash] = key
            held = holders.get(key, 0)  # inlined: this loop is every event's cost
            if held & bit:
                extra[key] = extra.get(key, 0) + 1  # the same tokens under another hash
            else:  # a lone bit is stored as the worker's own int object, not a copy
                holders[key] = held | bit if held else bit
        if len(by_vllm) > self.max_blocks_per_worker:
            self._evict(entry)

    def remove(self, worker_id: int, block_hashes: Iterable[BlockHash]) -> None:
        """BlockRemoved: evicted blocks (unknown hashes are ignored)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return
        if self._holders.dead:
            self._holders.sweep()
        copies = entry.copies
        for block_hash in block_hashes:
            if block_hash in copies:  # another physical block keeps the hash cached
                left = copies.pop(block_hash) - 1
                if left:
                    copies[block_hash] = left
                continue
            key = entry.by_vllm.pop(block_hash, None)
            if key is not None:
                self._release(entry, key)

    def clear(self, worker_id: int) -> None:
        """AllBlocksCleared: the cache is empty, so from here the index is complete."""
        entry = self._entry(worker_id)
        self._empty(entry)
        entry.clears += 1
        entry.holes = 0
        entry.trust = Trust.READY

    def status(self, worker_id: int) -> IndexStatus | None:
        entry = self._workers.get(worker_id)
        if entry is None:
            return None
        return IndexStatus(
            trust=entry.trust.value,
            blocks=len(entry.by_vllm),
            block_size=entry.block_size,
            next_seq=entry.next_seq,
            gaps=entry.gaps,
            restarts=entry.restarts,
            clears=entry.clears,
            orphans=entry.orphans,
            evicted=entry.evicted,
        )

    # -- internals -----------------------------------------------------------------------

    def _entry(self, worker_id: int) -> WorkerBlocks:
        entry = self._workers.get(worker_id)
        if entry is None:
            bit = self._holders.add_worker(worker_id)
            entry = self._workers[worker_id] = WorkerBlocks(bit)
        return entry

    def _release(self, entry: WorkerBlocks, key: int) -> None:
        copies = entry.extra.pop(key, 0)
        if copies > 1:
            entry.extra[key] = copies - 1
        elif not copies:
            self._holders.unhold(entry.bit, key)

    def _empty(self, entry: WorkerBlocks) -> None:
        """Drop every block of the worker at once: the holders map sweeps its old bit later
        (routing.kv.kv_holders), unless nobody else holds anything."""
        if all(other is entry or not other.by_vllm for other in self._workers.values()):
            self._holders.clear()
        elif entry.by_vllm:
            entry.bit = self._holders.retire(entry.bit, entry.by_vllm.values())
            entry.by_vllm = {}  # the old dict lives on in the sweep, unchanged
        entry.by_vllm.clear()
        entry.extra.clear()
        entry.copies.clear()

    def _reset(self, entry: WorkerBlocks) -> None:
        self._empty(entry)
        entry.trust = Trust.UNKNOWN
        entry.next_seq = None
        entry.catching_up = False
        entry.holes = 0
        entry.suspended = False

    def _evict(self, entry: WorkerBlocks) -> None:
        count = len(entry.by_vllm) - self.max_blocks_per_worker
        count += self.max_blocks_per_worker // _EVICT_SHARE
        oldest = list(itertools.islice(entry.by_vllm, count))
        for block_hash in oldest:
            entry.copies.pop(block_hash, None)
            self._release(entry, entry.by_vllm.pop(block_hash))
        entry.evicted += len(oldest)
