"""The bytes on their way: which headers go upstream and come back, and the answer's body
relayed chunk by chunk as it arrives (renamed back for an alias, the other routers told
before a stream's last event), or ended with vLLM's own error event when it breaks.

Used by the request path (routing.proxy) for every forwarded request; nothing here
decides where a request goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from itertools import chain
from time import perf_counter
from typing import Any

import aiohttp

from routing.asgi_types import Scope
from routing.errors import sse_error_event
from routing.exchange import Exchange
from routing.fleet.aliases import ModelNameRewriter
from routing.responses import reject

# Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the message.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# aiohttp sets these itself from the URL and the body it sends.
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# uvicorn writes its own Date and Server; relaying the worker's too would send both twice.
# x-request-id: the router sets its own (routing.telemetry.access_log), never the worker's echo
# twice.
RESPONSE_DROP = HOP_BY_HOP | {b"date", b"server", b"x-request-id"}
REQUEST_DROP_REWRITING = REQUEST_DROP | {b"accept-encoding"}
# A worker with its own key (vLLM --api-key) gets that key, never the client's header.
DROP_FOR_KEYED_WORKER = {d: d | {b"authorization"} for d in (REQUEST_DROP, REQUEST_DROP_REWRITING)}
_RESPONSE_DROP_RENAMED = RESPONSE_DROP | {b"content-length"}

# How an OpenAI stream's last event ends (vLLM's too): the relay tells the other routers
# that the worker's slot is free before it passes this on.
_SSE_DONE = b"data: [DONE]\n\n"


async def watch_disconnect(ex: Exchange, forward: asyncio.Task[Any]) -> None:
    while True:
        message = await ex.receive()
        if message["type"] == "http.disconnect":
            if not ex.answered:
                ex.client_gone = True
                forward.cancel()
            return


async def relay_body(ex: Exchange, content: aiohttp.StreamReader) -> None:
    send = ex.send
    # The first chunk apart, so the loop below carries no time-to-first-byte check.
    if chunk := await content.readany():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ex.got_first_byte(perf_counter())
    while chunk := await content.readany():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def relay_body_telling(
    ex: Exchange, content: aiohttp.StreamReader, before_done: Callable[[], Awaitable[None]]
) -> None:
    """The relay while other routers are live: a stream's last event (``data: [DONE]``)
    leaves only after `before_done` (the worker's slot given back and the other routers
    told, routing.peers.load_push), so the client's next request, through any router, finds the
    slot free."""
    first = True
    while chunk := await content.readany():
        if chunk.endswith(_SSE_DONE) and not ex.released:
            await before_done()
        await ex.send({"type": "http.response.body", "body": chunk, "more_body": True})
        if first:
            ex.got_first_byte(perf_counter())
            first = False


async def relay_body_renamed(
    ex: Exchange,
    content: aiohttp.StreamReader,
    rewriter: ModelNameRewriter,
    before_done: Callable[[], Awaitable[None]] | None = None,
) -> None:
    send = ex.send
    first = True
    while chunk := await content.readany():
        if first:
            ex.got_first_byte(perf_counter())
            first = False
        if out := rewriter.feed(chunk):
            if before_done is not None and out.endswith(_SSE_DONE) and not ex.released:
                await before_done()
            await send({"type": "http.response.body", "body": out, "more_body": True})
    if rest := rewriter.flush():
        if before_done is not None and rest.endswith(_SSE_DONE) and not ex.released:
            await before_done()
        await send({"type": "http.response.body", "body": rest, "more_body": True})


async def end_broken_stream(
    ex: Exchange, upstream: aiohttp.ClientResponse, exc: BaseException
) -> None:
    """Headers are gone already; the honest ending is vLLM's own in-stream error event."""
    if upstream.content_type == "text/event-stream":
        message = f"worker {ex.worker.name} failed mid-stream: {type(exc).__name__}"
        event = sse_error_event(message, path=ex.scope["path"])
        await ex.send({"type": "http.response.body", "body": event, "more_body": True})
    await ex.send({"type": "http.response.body", "body": b"", "more_body": False})


def usable_rewriter(
    rewriter: ModelNameRewriter | None, upstream: aiohttp.ClientResponse
) -> ModelNameRewriter | None:
    """Only JSON and SSE carry a `model` field, and only uncompressed bytes can be renamed."""
    if rewriter is None or upstream.headers.get("Content-Encoding", "identity") != "identity":
        return None
    kind = upstream.content_type
    return rewriter if kind in ("application/json", "text/event-stream") else None


def request_headers(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes] = REQUEST_DROP
) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.lower() not in drop]


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], renamed: bool = False
) -> list[tuple[bytes, bytes]]:
    # A renamed body may change length: it goes out chunked, without the worker's length.
    drop = _RESPONSE_DROP_RENAMED if renamed else RESPONSE_DROP
    return [(k, v) for k, v in raw if k.lower() not in drop]


async def receive_body(ex: Exchange, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await ex.receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await reject(ex, 413, f"the request body exceeds {limit} bytes")
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def headers_size(headers: Iterable[tuple[bytes, bytes]]) -> int:
    # map over the flattened pairs: the lengths are summed in C, no generator frame per
    # header on every request (#29).
    return sum(map(len, chain.from_iterable(headers)))
