"""The bytes on their way (routing.relay): headers each way, the request body read within
its limit, and answers relayed from a local aiohttp server chunk by chunk: as they come,
renamed back for an alias, the other routers told before a stream's last event, and a
broken stream ended with an error event."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.common.workers import worker_view
from routing.asgi_types import Message
from routing.fleet.aliases import ModelNameRewriter
from routing.policies import make_policy
from routing.policies.base import RequestInfo
from routing.relay import (
    REQUEST_DROP,
    end_broken_stream,
    receive_body,
    relay_body,
    relay_body_renamed,
    relay_body_telling,
    request_headers,
    response_headers,
    usable_rewriter,
)
from tests.support.exchanges import Client, exchange

EVENTS = [b'data: {"model":"m-v2","choices":[]}\n\n', b"data: [DONE]\n\n"]


def test_hop_by_hop_and_the_routers_own_headers_never_pass() -> None:
    raw = [(b"host", b"router"), (b"Connection", b"keep-alive"), (b"content-length", b"9"),
           (b"authorization", b"Bearer k"), (b"x-session-id", b"s")]  # fmt: skip
    assert request_headers(raw) == [("authorization", "Bearer k"), ("x-session-id", "s")]
    assert request_headers(raw, REQUEST_DROP | {b"authorization"}) == [("x-session-id", "s")]
    back = [(b"date", b"d"), (b"content-length", b"9"), (b"x-request-id", b"w"), (b"x-a", b"1")]
    assert response_headers(back) == [(b"content-length", b"9"), (b"x-a", b"1")]
    assert response_headers(back, renamed=True) == [(b"x-a", b"1")]  # its length may change


def receiving(*messages: Message) -> Any:
    queue = list(messages)

    async def receive() -> Message:
        return queue.pop(0)

    ex = exchange(None, request_id=b"r-1")
    ex.receive = receive
    return ex


def test_a_body_is_read_whole_within_its_limit() -> None:
    parts = receiving({"type": "http.request", "body": b"ab", "more_body": True},
                      {"type": "http.request", "body": b"cd"})  # fmt: skip
    assert asyncio.run(receive_body(parts, 10)) == b"abcd"
    gone = receiving({"type": "http.request", "body": b"ab", "more_body": True},
                     {"type": "http.disconnect"})  # fmt: skip
    assert asyncio.run(receive_body(gone, 10)) is None and gone.status == 0
    big = receiving({"type": "http.request", "body": b"x" * 11})
    assert asyncio.run(receive_body(big, 10)) is None and big.status == 413


Relay = Callable[[Any, aiohttp.ClientResponse], Awaitable[None]]


def relayed(chunks: list[bytes], relay: Relay, *, break_after: int | None = None) -> Client:
    """Answer `chunks` from a local server, one write each, and relay them to a client."""

    async def stream(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for i, chunk in enumerate(chunks):
            if i == break_after:
                assert request.transport is not None
                request.transport.close()  # the worker dies mid-stream
                return answer
            await answer.write(chunk)
            await asyncio.sleep(0)
        return answer

    async def main() -> Client:
        app = web.Application()
        app.router.add_get("/", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = Client()
        ex = exchange(client, model="m")
        ex.policy, ex.worker = make_policy("round_robin", {}), worker_view(1)
        ex.request = RequestInfo("m", {}, [])
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/") as r,
            ):
                await relay(ex, r)
        finally:
            await runner.cleanup()
        assert ex.first_byte is not None or not client.sent
        return client

    return asyncio.run(main())


def test_an_answer_is_relayed_untouched_as_it_comes() -> None:
    client = relayed(EVENTS, lambda ex, r: relay_body(ex, r.content))
    assert client.body == b"".join(EVENTS)
    assert all(m["more_body"] for m in client.sent)  # the proxy ends the answer


def test_a_streams_last_event_waits_until_the_other_routers_are_told() -> None:
    done_seen: list[bool] = []  # at each telling: had the client got [DONE] yet?

    async def told(ex: Any, r: aiohttp.ClientResponse) -> None:
        async def before_done() -> None:
            sent = b"".join(m.get("body", b"") for m in ex.send.__self__.sent)
            done_seen.append(b"[DONE]" in sent)

        await relay_body_telling(ex, r.content, before_done)

    client = relayed(EVENTS, told)
    assert client.body.endswith(b"data: [DONE]\n\n")
    assert done_seen == [False]  # told once, before [DONE] reached the client


def test_an_aliass_answer_is_renamed_back_across_chunk_boundaries() -> None:
    cut = [EVENTS[0][:12], EVENTS[0][12:], EVENTS[1]]  # `"model":"m-` | `v2"`
    client = relayed(
        cut, lambda ex, r: relay_body_renamed(ex, r.content, ModelNameRewriter("m-v2", "chat"))
    )
    assert client.body == b'data: {"model":"chat","choices":[]}\n\ndata: [DONE]\n\n'


def test_a_stream_that_breaks_ends_with_vllms_error_event() -> None:
    async def relay(ex: Any, r: aiohttp.ClientResponse) -> None:
        try:
            await relay_body(ex, r.content)
        except aiohttp.ClientPayloadError as exc:
            await end_broken_stream(ex, r, exc)

    client = relayed([*EVENTS[:1], b"never"], relay, break_after=1)
    last_event = client.body.split(b"\n\n")[-2]
    assert b"worker w1 failed mid-stream" in last_event
    assert orjson.loads(last_event.removeprefix(b"data: "))["error"]["code"] == 502
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_only_uncompressed_json_and_sse_answers_are_renamed() -> None:
    rewriter = ModelNameRewriter("m", "chat")

    async def check(request: web.Request) -> web.Response:
        kind = request.query["kind"]
        headers = {"Content-Encoding": "gzip"} if kind == "gzip" else {}
        content_type = "application/json" if kind == "gzip" else kind
        return web.Response(body=b"{}", content_type=content_type, headers=headers)

    async def main() -> list[bool]:
        app = web.Application()
        app.router.add_get("/", check)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        out = []
        try:
            async with aiohttp.ClientSession(auto_decompress=False) as session:
                for kind in ("application/json", "text/event-stream", "text/plain", "gzip"):
                    async with session.get(f"http://127.0.0.1:{port}/", params={"kind": kind}) as r:
                        out.append(usable_rewriter(rewriter, r) is rewriter)
        finally:
            await runner.cleanup()
        return out

    assert asyncio.run(main()) == [True, True, False, False]
