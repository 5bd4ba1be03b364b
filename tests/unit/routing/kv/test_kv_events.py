"""Decoding vLLM's KV cache events from the bytes its publisher sends.

The structs below mirror vLLM's own definitions (vllm/distributed/kv_events.py): the current
ones (maps, `omit_defaults`, tagged), and the 2025 ones (`array_like`), as its reference
subscriber (examples/online_serving/kv_events_subscriber.py) declares them. Payloads are
encoded with msgspec exactly as ZmqEventPublisher does (`msgspec.msgpack.Encoder().encode`)
and framed as it frames them."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from routing.kv import kv_events
from routing.kv.kv_events import MalformedBatch, apply_batch, decode_batch
from routing.kv.kv_index import KvIndex, SeqVerdict
from tests.support.common import DATA

CAPTURES = DATA / "vllm-captures"

# -- vLLM 0.32's definitions (vllm/distributed/kv_events.py): the batch array_like, its events
# maps tagged by "type" -- what a real engine sends (tests/data/vllm-captures) -----------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- vLLM's 2025 definitions (array_like) ------------------------------------------------------


class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(OldEventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


ENCODER = msgspec.msgpack.Encoder()  # what ZmqEventPublisher's thread uses


def frames(seq: int, batch: Any, topic: bytes = b"kv-events") -> list[bytes]:
    """One message exactly as ZmqEventPublisher sends it."""
    return [topic, seq.to_bytes(8, "big"), ENCODER.encode(batch)]


def stored(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return BlockStored(hashes, parent, tokens, 4, **fields)


def test_current_encoding_is_an_array_of_maps_tagged_by_type_and_decodes() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            stored([11, 12], None, list(range(8)), extra_keys=[None, ("salt",)], group_idx=0),
            BlockRemoved([11], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    seq, payload = kv_events.published_message(frames(7, batch))
    assert seq == 7
    assert payload[0] == 0x93  # [ts, events, rank], as a real engine's first byte
    assert b"\xa4type\xabBlockStored" in payload  # the events: maps tagged by type
    decoded = decode_batch(payload)
    assert decoded.ts == 1.5 and decoded.data_parallel_rank == 0
    first, second, third = decoded.events
    assert isinstance(first, kv_events.BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.block_size) == ([11, 12], None, 4)
    assert first.token_ids == list(range(8)) and first.medium == "GPU"
    assert isinstance(second, kv_events.BlockRemoved) and second.block_hashes == [11]
    assert isinstance(third, kv_events.AllBlocksCleared)


def test_omitted_defaults_decode() -> None:
    # omit_defaults drops every default event field (an array batch keeps its three items).
    payload = ENCODER.encode(KVEventBatch(ts=2.0, events=[BlockRemoved([5], None)]))
    assert payload[0] == 0x93 and b"group_idx" not in payload
    decoded = decode_batch(payload)
    assert decoded.data_parallel_rank is None
    assert isinstance(decoded.events[0], kv_events.BlockRemoved)


def test_2025_array_encoding_decodes() -> None:
    batch = OldKVEventBatch(
        ts=3.0,
        events=[
            OldBlockStored([21, 22], 20, list(range(8)), 4, 7, None),
            OldBlockRemoved([21], None),
            OldAllBlocksCleared(),
        ],
    )
    payload = ENCODER.encode(batch)
    assert payload[0] & 0xF0 == 0x90  # a msgpack array, the event's tag first
    decoded = decode_batch(payload)
    first, second, third = decoded.events
    assert isinstance(first, kv_events.ArrayBlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.lora_id) == ([21, 22], 20, 7)
    assert isinstance(second, kv_events.ArrayBlockRemoved)
    assert isinstance(third, kv_events.ArrayAllBlocksCleared)


def test_fields_a_newer_vllm_adds_are_ignored() -> None:
    class FutureBlockStored(BlockStored, tag="BlockStored"):
        hash_algo: str = ""

    class FutureBatch(EventBatch):
        events: list[FutureBlockStored]
        origin: str = ""

    event = FutureBlockStored([1], None, [1, 2, 3, 4], 4, None, None, None, hash_algo="xxh")
    payload = ENCODER.encode(FutureBatch(ts=1.0, events=[event], origin="engine-3"))
    assert b"hash_algo" in payload and b"engine-3" in payload  # a fourth item, then
    event = decode_batch(payload).events[0]
    assert isinstance(event, kv_events.BlockStored) and event.block_hashes == [1]
    # Arrays: a trailing item (a field appended later) is ignored too.
    old = ENCODER.encode([1.0, [["BlockRemoved", [9], None, 3, "more"]], 0, "extra"])
    assert decode_batch(old).events[0].block_hashes == [9]


def test_bytes_block_hashes_are_opaque_keys() -> None:
    # sha256 hashing gives bytes hashes; they chain and remove like ints.
    index = KvIndex()
    first, second = b"\x01" * 32, b"\x02" * 32
    tokens = list(range(8))
    batch = KVEventBatch(ts=0.0, events=[stored([first], None, tokens[:4])])
    follow = KVEventBatch(ts=0.0, events=[stored([second], first, tokens[4:])])
    for seq, b in enumerate((batch, follow)):
        _, payload = kv_events.published_message(frames(seq, b))
        assert index.check_sequence(1, seq) is SeqVerdict.APPLY
        apply_batch(index, 1, decode_batch(payload))
    assert index.cached_blocks(1, tokens) == 2
    removed = KVEventBatch(0.0, [BlockRemoved([second], "GPU")])
    apply_batch(index, 1, decode_batch(ENCODER.encode(removed)))
    assert index.cached_blocks(1, tokens) == 1


def test_blocks_off_the_gpu_are_left_out() -> None:
    # With KV offloading, vLLM also reports blocks stored on (or removed from) the CPU tier:
    # the same hashes, another medium. They must neither add nor take away GPU blocks.
    index = KvIndex()
    index.check_sequence(1, 0)
    tokens = list(range(4))
    events = [stored([1], None, tokens), stored([1], None, tokens, medium="CPU")]
    apply_batch(index, 1, decode_batch(ENCODER.encode(KVEventBatch(0.0, events))))
    removed = KVEventBatch(0.0, [BlockRemoved([1], "CPU")])
    apply_batch(index, 1, decode_batch(ENCODER.encode(removed)))
    assert index.cached_blocks(1, tokens) == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        ENCODER.encode({"ts": "yesterday", "events": []}),
        ENCODER.encode({"ts": 1.0, "events": [{"type": "BlockEvaporated"}]}),
        ENCODER.encode({"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": "x"}]}),
        ENCODER.encode([1.0, [["BlockStored", [1], None]]]),  # required fields missing
        ENCODER.encode(42),
    ],
)
def test_malformed_payloads_raise_malformed_batch(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_malformed_frames_raise_malformed_batch() -> None:
    good = ENCODER.encode(KVEventBatch(0.0, []))
    with pytest.raises(MalformedBatch):
        kv_events.published_message([b"kv-events", good])  # no sequence number
    with pytest.raises(MalformedBatch):
        kv_events.published_message([b"kv-events", b"\x00\x01", good])  # 2-byte sequence
    with pytest.raises(MalformedBatch):
        kv_events.replayed_message([(0).to_bytes(8, "big"), good])  # no empty delimiter


def test_stored_event_with_too_few_tokens_is_malformed() -> None:
    index = KvIndex()
    index.check_sequence(1, 0)
    short = KVEventBatch(0.0, [stored([1, 2], None, [1, 2, 3, 4, 5])])  # 2 blocks of 4: 8 ids
    with pytest.raises(MalformedBatch):
        apply_batch(index, 1, decode_batch(ENCODER.encode(short)))


def test_replay_protocol_frames() -> None:
    # A DEALER's request and the ROUTER's answers once the identity frame is stripped.
    assert kv_events.replay_request(5) == [b"", (5).to_bytes(8, "big")]
    payload = ENCODER.encode(KVEventBatch(0.0, []))
    five = (5).to_bytes(8, "big")
    assert kv_events.replayed_message([b"", b"kv-events", five, payload]) == (5, payload)
    end = (-1).to_bytes(8, "big", signed=True)  # vLLM's END_SEQ
    assert kv_events.replayed_message([b"", b"", end, b""]) == (kv_events.END_OF_REPLAY, b"")


def test_vllm_032_replay_answer_as_captured_decodes_and_applies() -> None:
    # Frame by frame, what a real vLLM 0.32 replay socket answered (tests/data): four frames
    # a batch, the topic before the sequence number; the batch an array of map events.
    captured = json.loads((CAPTURES / "replay-frames.json").read_text())
    messages = [[bytes.fromhex(frame["hex"]) for frame in message] for message in captured]
    assert all(len(message) == 4 for message in messages)
    index = KvIndex()
    seqs = []
    for message in messages:
        seq, payload = kv_events.replayed_message(message)
        seqs.append(seq)
        if seq == kv_events.END_OF_REPLAY:
            break
        assert payload[0] == 0x93  # [ts, events, data_parallel_rank]
        assert index.check_sequence(1, seq) is SeqVerdict.APPLY
        assert apply_batch(index, 1, decode_batch(payload)) == 1
    assert seqs == [0, 1, 2, kv_events.END_OF_REPLAY]
    status = index.status(1)
    assert status is not None and status.block_size == 128 and status.blocks > 0
    assert status.orphans == 0


def test_older_three_frame_replay_answers_still_read() -> None:
    payload = ENCODER.encode(KVEventBatch(0.0, []))
    assert kv_events.replayed_message([b"", (7).to_bytes(8, "big"), payload]) == (7, payload)


def test_hybrid_models_index_only_their_full_attention_groups() -> None:
    # A sliding-window group stores the same blocks, then drops those left of its window:
    # that says nothing about the prefix a request reuses, so it must not remove them.
    index = KvIndex()
    index.check_sequence(1, 0)
    tokens = list(range(8))
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    window = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    stores = [stored([1, 2], None, tokens, **full), stored([1, 2], None, tokens, **window)]
    apply_batch(index, 1, decode_batch(ENCODER.encode(KVEventBatch(0.0, stores))))
    slid = KVEventBatch(0.0, [BlockRemoved([1], "GPU", group_idx=1)])
    apply_batch(index, 1, decode_batch(ENCODER.encode(slid)))
    assert index.cached_blocks(1, tokens) == 2
    evicted = KVEventBatch(0.0, [BlockRemoved([1], "GPU", group_idx=0)])
    apply_batch(index, 1, decode_batch(ENCODER.encode(evicted)))
    assert index.cached_blocks(1, tokens) == 0
