"""vLLM's KV cache events as they travel: the ZeroMQ frames and the msgpack payload.

**Frames** (vllm/distributed/kv_events.py, ``ZmqEventPublisher``). The PUB socket sends each
batch as three frames: the topic, the sequence number (8 bytes, big-endian, from 0 when the
engine starts) and the payload. The optional replay socket is a ROUTER: a DEALER sends
``(b"", start_seq)`` (8 bytes, big-endian) and gets back, as vLLM 0.32 answers,
``(b"", topic, seq, payload)`` for every buffered batch from `start_seq` on, then
``(b"", b"", -1 as 8 signed bytes, b"")``. Older engines left the topic out (three frames:
``(b"", seq, payload)``, ended by ``(b"", -1, b"")``); both are read.

**Payload.** msgpack of ``KVEventBatch(ts, events, data_parallel_rank)``, whose events are
tagged msgspec structs, the tag being the class name. The batch and its events are encoded
apart, each either as a msgpack array (``array_like``) or a map, so each level is decoded by
what it is:

* vLLM 0.32 (captured in tests/data/vllm-captures): the batch is an array
  ``[ts, events, data_parallel_rank]`` (``EventBatch(array_like=True)``, first byte 0x93)
  whose events are maps tagged by a ``type`` field (``KVCacheEvent(omit_defaults=True,
  tag=True)``: a field equal to its default may be missing);
* older vLLM (2025): arrays all the way down, each event's tag its first item;
* a batch as a map of map events, which no release we know sends, is read too.

Fields a newer vLLM adds are ignored (maps: unknown keys; arrays: trailing items). A payload
that decodes to none of these is :class:`MalformedBatch`, which the subscriber logs and
counts.

**Hybrid models** (sliding-window or mamba layers beside full attention) report each KV
cache group's blocks with its ``group_idx``, and its kind on stores. Only full-attention
groups are indexed: a sliding-window group drops blocks outside its window all the time,
which says nothing about the prefix a request can reuse. Blocks off the GPU (an offloading
tier's ``medium``) are left out too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from routing.kv.kv_index import BlockHash, KvIndex

END_OF_REPLAY = -1
FULL_ATTENTION = "full_attention"  # vLLM's KVCacheSpecKind.FULL_ATTENTION
SEQ_BYTES = 8


class MalformedBatch(ValueError):
    """Frames or a payload that are not vLLM's KV events."""


# -- current vLLM: maps, tagged by a `type` field -------------------------------------------


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


class KVEventBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class ArrayBatchOfMaps(msgspec.Struct, array_like=True, gc=False):
    """vLLM 0.32: the batch an array, its events maps."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- older vLLM: arrays, the tag first -------------------------------------------------------


class ArrayBlockStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class ArrayBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class ArrayKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


AnyBatch = KVEventBatch | ArrayBatchOfMaps | ArrayKVEventBatch
_STORED = (BlockStored, ArrayBlockStored)
_REMOVED = (BlockRemoved, ArrayBlockRemoved)

_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
# An array batch: vLLM 0.32's map events first (what every current engine sends), then
# the older array events.
_array_decoders = (
    msgspec.msgpack.Decoder(ArrayBatchOfMaps),
    msgspec.msgpack.Decoder(ArrayKVEventBatch),
)


def decode_batch(payload: bytes) -> AnyBatch:
    """One payload, in whichever encoding it came: the batch's first msgpack byte tells an
    array from a map; an array batch's events are tried as maps, then as arrays."""
    if not payload:
        raise MalformedBatch("empty payload")
    decoders = _array_decoders if _is_array(payload[0]) else (_map_decoder,)
    error: Exception | None = None
    for decoder in decoders:
        try:
            batch: AnyBatch = decoder.decode(payload)
            return batch
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error = exc
    raise MalformedBatch(f"not a KVEventBatch: {error}")


def _is_array(first: int) -> bool:
    # fixarray 0x90..0x9f, array16 0xdc, array32 0xdd; maps are 0x80..0x8f, 0xde, 0xdf.
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def published_message(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """(sequence number, payload) of one message from the PUB socket."""
    if len(frames) != 3:
        raise MalformedBatch(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return _sequence(frames[1]), frames[2]


def replayed_message(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """(sequence number, payload) of one answer on a DEALER; seq -1 ends the replay.
    vLLM 0.32 sends ``(b"", topic, seq, payload)``, older engines ``(b"", seq, payload)``."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise MalformedBatch(
            f"expected (b'', topic, seq, payload) from the replay socket, got {len(frames)} "
            f"frames: {_brief(frames)}"
        )
    return _sequence(frames[-2]), frames[-1]


def _brief(frames: Sequence[bytes]) -> str:
    return ", ".join(repr(frame[:16]) for frame in frames[:5])


def _sequence(raw: bytes) -> int:
    if len(raw) != SEQ_BYTES:
        raise MalformedBatch(f"a sequence number is {SEQ_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


def lora_key(event: BlockStored | ArrayBlockStored) -> str | int | None:
    """The adapter a stored block belongs to: its name when the engine sends one."""
    return event.lora_name if event.lora_name is not None else event.lora_id


def apply_batch(index: KvIndex, worker_id: int, batch: AnyBatch) -> int:
    """Apply one batch's events in order; returns how many there were. A BlockStored that
    does not add up (fewer tokens than blocks) raises MalformedBatch after the events
    before it were applied, as vLLM would have applied them."""
    gpu_events = [e for e in batch.events if _on_gpu(e)]
    for event in gpu_events:
        if isinstance(event, _STORED):
            if _full_attention(event):
                _store(index, worker_id, event)
            elif event.group_idx is not None:
                index.skip_group(worker_id, event.group_idx)
        elif isinstance(event, _REMOVED):
            if not index.skips_group(worker_id, event.group_idx):
                index.remove(worker_id, event.block_hashes)
        else:
            index.clear(worker_id)
    return len(batch.events)


def _full_attention(event: BlockStored | ArrayBlockStored) -> bool:
    # No kind: an engine without hybrid groups (or before the field existed).
    return event.kv_cache_spec_kind in (None, FULL_ATTENTION)


def _on_gpu(event: Any) -> bool:
    """Blocks offloaded to CPU or disk (medium other than GPU) are not what prefill reuses
    first; None is what engines without offloading send."""
    medium = getattr(event, "medium", None)
    return medium is None or medium == "GPU"


def _store(index: KvIndex, worker_id: int, event: BlockStored | ArrayBlockStored) -> None:
    try:
        index.store(
            worker_id,
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            lora_key(event),
        )
    except ValueError as exc:
        raise MalformedBatch(str(exc)) from exc
