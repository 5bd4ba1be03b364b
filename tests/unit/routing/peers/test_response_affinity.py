"""Responses API pinning (routing.peers.response_affinity): the ids read off answers as
they are relayed, the routes that name one, and the ids shared between replicas through a
real Redis (skipped without REDIS_URL, as test_leases_redis.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import orjson

from routing.asgi_types import Message
from routing.exchange import Exchange
from routing.peers.response_affinity import (
    ResponseAffinity,
    by_id,
    previous_id,
)
from routing.shared_store import SharedStore
from tests.support.common import REDIS_URL, needs_redis


def affinity(
    me: str = "r1", store: SharedStore | None = None, namespace: str = ""
) -> ResponseAffinity:
    return ResponseAffinity(me, store, lambda: namespace, lambda: True)


async def relay(
    pins: ResponseAffinity, payload: dict[str, Any], status: int, content_type: bytes,
    *chunks: bytes,
) -> list[Message]:  # fmt: skip
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    ex = Exchange({"type": "http"}, receive, send, 0.0, model="m", worker_id=3)
    wrapped = pins.catch_ids(ex, payload)
    await wrapped({"type": "http.response.start", "status": status,
                   "headers": [(b"Content-Type", content_type)]})  # fmt: skip
    for chunk in chunks:
        await wrapped({"type": "http.response.body", "body": chunk, "more_body": True})
    return sent


def test_the_routes_that_name_a_response() -> None:
    assert by_id("/v1/responses/resp_1", "GET") == ("resp_1", False)
    assert by_id("/v1/responses/resp_1/cancel", "POST") == ("resp_1", True)
    assert by_id("/v1/responses/resp_1", "POST") is None
    assert by_id("/v1/responses/resp_1/cancel", "GET") is None
    assert by_id("/v1/responses/a/b", "GET") is None
    assert by_id("/v1/responses/" + "x" * 257, "GET") is None
    assert previous_id({"previous_response_id": "resp_1"}) == "resp_1"
    assert previous_id({"previous_response_id": ""}) is None
    assert previous_id({"previous_response_id": 7}) is None


def test_a_whole_answers_leading_id_is_recorded_and_the_bytes_pass_untouched() -> None:
    pins = affinity()
    body = b'{"id": "resp_abc", "object": "response", "output": []}'
    sent = asyncio.run(relay(pins, {}, 200, b"application/json", body[:9], body[9:]))
    assert b"".join(m.get("body", b"") for m in sent) == body
    holder = asyncio.run(pins.find("resp_abc"))
    assert holder is not None and (holder.worker_id, holder.model, holder.found_in) == (
        3, "m", "memory",
    )  # fmt: skip
    assert pins.recorded == 1


def test_a_streamed_answers_id_comes_from_its_response_created_event() -> None:
    pins = affinity()
    event = {"type": "response.created", "response": {"id": "resp_s", "status": "queued"}}
    first = b"event: response.created\ndata: " + orjson.dumps(event) + b"\n\n"
    asyncio.run(relay(pins, {"stream": True}, 200, b"text/event-stream; charset=utf-8", first))
    assert set(pins.held) == {"resp_s"}


def test_errors_unstored_answers_and_answers_without_a_leading_id_record_nothing() -> None:
    pins = affinity()
    asyncio.run(relay(pins, {}, 404, b"application/json", b'{"id": "resp_x"}'))
    asyncio.run(relay(pins, {"store": False}, 200, b"application/json", b'{"id": "resp_y"}'))
    asyncio.run(relay(pins, {}, 200, b"application/json", b'{"object": "x", "id": "resp_z"}' * 20))
    assert pins.held == {} and pins.recorded == 0


def test_a_peers_batch_is_applied_and_its_own_echo_dropped() -> None:
    pins = affinity("r1")
    pins.take(b"r2 " + msgpack.packb([["resp_p", 4, "m"]]))
    pins.take(b"r1 " + msgpack.packb([["resp_own", 5, "m"]]))
    pins.take(b"r2 not msgpack at all")
    assert set(pins.held) == {"resp_p"}
    assert (pins.applied, pins.errors) == (1, 1)


def test_an_expired_id_is_forgotten() -> None:
    pins = affinity()
    pins.record("resp_old", 1, "m")
    worker, model, _ = pins.held["resp_old"]
    pins.held["resp_old"] = (worker, model, time.time() - 1)
    assert asyncio.run(pins.find("resp_old")) is None
    assert "resp_old" not in pins.held


async def wait_for(condition: Callable[[], Awaitable[bool]], ceiling: float = 10.0) -> None:
    deadline = time.monotonic() + ceiling
    while not await condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


@needs_redis
def test_a_replica_finds_an_id_another_recorded_by_message_and_by_lookup() -> None:
    namespace = f"test-{uuid.uuid4().hex}"

    async def scenario() -> tuple[str, str, int]:
        stores = [SharedStore(REDIS_URL), SharedStore(REDIS_URL)]
        one, two = affinity("r1", stores[0], namespace), affinity("r2", stores[1], namespace)
        await one.start()
        await two.start()
        try:
            await asyncio.sleep(0)
            assert one.sharing()
            # The listener subscribes in the background: record until the peer hears one.
            n = 0

            async def heard() -> bool:
                nonlocal n
                n += 1
                one.record(f"resp_{n}", 7, "m")
                await one.delivered()
                return bool(two.held)

            await wait_for(heard)
            by_message = await two.find(next(iter(two.held)))
            late = affinity("r3", stores[1], namespace)  # started after: not in memory
            by_lookup = await late.find("resp_1")
            assert by_message is not None and by_lookup is not None
            assert (by_lookup.worker_id, by_lookup.model) == (7, "m")
            assert "resp_1" in late.held  # kept once found
            return by_message.found_in, by_lookup.found_in, late.lookups
        finally:
            await one.stop()
            await two.stop()
            keys = [k async for k in stores[0].client.scan_iter(f"controlpanel:{namespace}:*")]
            if keys:
                await stores[0].client.delete(*keys)
            for store in stores:
                await store.close()

    assert asyncio.run(scenario()) == ("memory", "redis", 1)


@needs_redis
def test_an_id_nobody_recorded_is_looked_up_once_and_not_found() -> None:
    async def scenario() -> tuple[Any, int]:
        store = SharedStore(REDIS_URL)
        try:
            pins = affinity("r1", store, f"test-{uuid.uuid4().hex}")
            return await pins.find("resp_missing"), pins.lookups
        finally:
            await store.close()

    assert asyncio.run(scenario()) == (None, 1)


def test_without_a_namespace_nothing_is_looked_up() -> None:
    async def scenario() -> int:
        store = SharedStore("redis://127.0.0.1:1/0")
        try:
            pins = affinity("r1", store, "")
            assert await pins.find("resp_q") is None
            return pins.lookups
        finally:
            await store.close()

    assert asyncio.run(scenario()) == 0
