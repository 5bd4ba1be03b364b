"""The simulator's KV cache events, published as vLLM 0.32 publishes them.

vLLM's ``ZmqEventPublisher`` (vllm/distributed/kv_events.py), rebuilt: a PUB socket sends
each batch as ``(topic, 8-byte big-endian sequence number, msgpack payload)``, the numbers
counting from 0 when the server starts; the last ``buffer_steps`` batches are kept for a
ROUTER replay socket. A DEALER asks it with ``(b"", start_seq)``; it answers
``(b"", topic, seq, payload)`` for each buffered batch from `start_seq`, then the end marker
``(b"", b"", -1, b"")`` (-1 as 8 signed big-endian bytes), as captured from vLLM 0.32
(shared/vllm-captures/replay-frames.json).

The payload is msgspec's msgpack of ``KVEventBatch(ts, events, data_parallel_rank)``. As in
vLLM 0.32 the batch is ``array_like`` (a msgpack array of 3, first byte 0x93) while each event
is a map tagged by its class name in ``"type"``, defaults left out (``omit_defaults``); the
structs mirror vLLM's field for field and in vLLM's order, so one event encodes to the same
bytes as vLLM's. ``legacy=True`` encodes as 2025's vLLM did (events as arrays too, the tag
first, fewer fields).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

BlockHash = int | bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HWM = 100_000  # vLLM's KVEventsConfig defaults: hwm and max_queue_size


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of every KV cache event."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: None, or the keys besides the tokens that its hash covers (the
    # LoRA's name). vLLM 0.32 always sends it, and group_idx and kv_cache_spec_kind too.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # New in 0.32, left out while None (so never sent by the simulator).
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def legacy_form(event: Any) -> list[Any]:
    """An event as 2025's array_like vLLM sent it: the tag, then its fields in order (the
    fields it had then)."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                event.block_size, event.lora_id, event.medium]  # fmt: skip
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """A batch's payload, byte for byte as vLLM 0.32 encodes it."""
    return _ENCODER.encode(batch)


class KvEventPublisher:
    """PUB on `port` (and ROUTER replay on `replay_port`, when given), bound on `host`."""

    def __init__(
        self,
        host: str,
        port: int,
        replay_port: int | None = None,
        *,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        legacy: bool = False,
    ) -> None:
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = f"tcp://{host}:{replay_port}" if replay_port else ""
        self.port, self.replay_port, self.buffer_steps = port, replay_port, buffer_steps
        self.topic = topic.encode()
        self.legacy = legacy
        self._seq = count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = _ENCODER
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, _HWM)
        self._pub.bind(self.endpoint)
        # The same socket, driven synchronously: a PUB send never blocks (past the high
        # water mark it drops, as vLLM's does), so the engine publishes in line.
        self._pub_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._pub.underlying)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        self.published = 0
        self._lose = 0

    def config(self) -> dict[str, Any]:
        """The publisher as vLLM's ``GET /kv_event_sources`` shows it (one data-parallel rank):
        its KVEventsConfig, endpoints as given on the command line (bound on every
        interface), not as bound here."""
        replay = f"tcp://*:{self.replay_port}" if self.replay_port else None
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.port}",
            "replay_endpoint": replay,
            "buffer_steps": self.buffer_steps,
            "hwm": _HWM,
            "max_queue_size": _HWM,
            "topic": self.topic.decode(),
        }

    def publish(self, events: list[Any]) -> int:
        """Send one batch now; returns its sequence number."""
        seq = next(self._seq)
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        if self.legacy:
            payload = self._encoder.encode([batch.ts, [legacy_form(e) for e in events], 0])
        else:
            payload = encode_batch(batch)
        if self._lose:
            self._lose -= 1  # buffered for replay, never sent: lost on the way
        else:
            self.send_raw(seq, payload)
        self._buffer.append((seq, payload))
        self.published += 1
        return seq

    def lose_next(self, batches: int) -> None:
        """Tests: the next `batches` are kept for replay but never sent, as a batch that a
        slow subscriber's high water mark dropped."""
        self._lose += batches

    def send_raw(self, seq: int, payload: bytes) -> None:
        """One message as the PUB socket sends it (tests also send broken ones with it)."""
        frames = [self.topic, seq.to_bytes(8, "big", signed=seq < 0), payload]
        with contextlib.suppress(zmq.Again):
            self._pub_now.send_multipart(frames, flags=zmq.NOBLOCK)

    def next_seq(self) -> int:
        """Take a sequence number without publishing (tests: a batch lost on the way)."""
        return next(self._seq)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV events replay request: %r", frames)
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    frames = [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    await self._replay.send_multipart(frames)
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
