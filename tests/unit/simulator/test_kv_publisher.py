"""simulator.kv_publisher: batches published on a PUB socket numbered from 0, kept for the
replay socket, lost on purpose for tests, and the legacy array encoding."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from simulator.kv_publisher import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    KvEventPublisher,
    legacy_form,
)
from tests.support.servers import free_port
from tests.support.vllm_contract import assert_kv_batch

CEILING_S = 60.0


async def subscribed(ctx: zmq.asyncio.Context, pub: KvEventPublisher) -> zmq.asyncio.Socket:
    """A SUB socket that receives: publishes until one message arrives (a slow joiner)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CEILING_S
    while not await sub.poll(50):
        assert loop.time() < deadline, "the subscriber never received"
        pub.publish([AllBlocksCleared()])
    return sub


async def next_from(sub: zmq.asyncio.Socket, seq: int) -> tuple[int, bytes]:
    """The first message numbered `seq` or later (the warm-up batches are skipped)."""
    while True:
        _, raw, payload = await asyncio.wait_for(sub.recv_multipart(), CEILING_S)
        if int.from_bytes(raw, "big") >= seq:
            return int.from_bytes(raw, "big"), payload


def test_batches_are_numbered_sent_lost_on_purpose_and_replayed() -> None:
    async def scenario() -> None:
        pub = KvEventPublisher("127.0.0.1", free_port(), free_port(), buffer_steps=1000)
        ctx = zmq.asyncio.Context()
        try:
            sub = await subscribed(ctx, pub)
            first = pub.publish([BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)])
            assert first == pub.published - 1  # numbered from 0, one a batch
            seq, payload = await next_from(sub, first)
            [removed] = assert_kv_batch(payload)
            assert seq == first and removed["block_hashes"] == [7]
            pub.lose_next(1)
            lost = pub.publish([AllBlocksCleared()])
            after = pub.publish([AllBlocksCleared()])
            assert (await next_from(sub, lost))[0] == after == lost + 1  # the lost one never came
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
            await dealer.send_multipart([b"", lost.to_bytes(8, "big")])
            replayed = []
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), CEILING_S)
                if frames[2] == END_SEQ:
                    break
                replayed.append(int.from_bytes(frames[2], "big"))
            assert replayed == [lost, after]
            dealer.close(linger=0)
            sub.close(linger=0)
        finally:
            await pub.close()
            ctx.term()

    asyncio.run(scenario())


def test_config_shows_the_endpoints_on_every_interface() -> None:
    async def scenario() -> dict[str, object]:
        port = free_port()
        pub = KvEventPublisher("127.0.0.1", port, buffer_steps=5)
        try:
            return {**pub.config(), "port": port}
        finally:
            await pub.close()

    config = asyncio.run(scenario())
    assert config["endpoint"] == f"tcp://*:{config['port']}"
    assert config["replay_endpoint"] is None and config["buffer_steps"] == 5
    assert config["topic"] == "kv-events" and config["publisher"] == "zmq"


def test_the_legacy_form_is_an_array_tag_first() -> None:
    removed = BlockRemoved(block_hashes=[1, 2], medium="GPU", group_idx=0)
    form = legacy_form(removed)
    assert form[0] == "BlockRemoved" and form[1] == [1, 2]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(legacy_form(AllBlocksCleared()))) == [
        "AllBlocksCleared"
    ]
