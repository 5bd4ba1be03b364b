"""The floor proxy with its upstream client swapped: what a router on uvicorn would cost if
aiohttp's client were replaced by a minimal HTTP/1.1 client (#29: "where a target cannot be
reached on this stack, show ... what it would take").

``bench.overhead --floor-raw`` runs it as mode ``floor-raw``, with exactly the floor's uvicorn
command line and ``FLOOR_UPSTREAMS``, and does per request exactly what
``bench.common.floor_proxy`` does (read and parse the body, POST the untouched bytes to the
next upstream of the model, relay status, headers minus ``RESPONSE_DROP`` and every body
chunk), except that the upstream side is an ``asyncio.Protocol`` per connection that writes
the request head and body in one ``write`` and feeds what arrives to httptools' C response
parser (the parser uvicorn already uses for requests), with a keep-alive pool per upstream.

It is a measurement, not a product: no timeouts, no flow control toward a slow client (the
chunks a client has not taken yet are queued), no retry of a request sent on a connection the
upstream had just closed, no TLS, no redirects, no proxy. A production client would need all
of those, and each costs something; so the figure is a lower bound on what replacing aiohttp
could save, not a promise.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import deque
from collections.abc import Iterator
from typing import cast
from urllib.parse import urlsplit

import httptools
import orjson

from bench.common.floor_proxy import ANY_MODEL, parse_upstreams
from routing.asgi_types import Receive, Scope, Send
from routing.relay import RESPONSE_DROP

Address = tuple[str, int]


class UpstreamConnection(asyncio.Protocol):
    """One kept-alive connection to an upstream; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.chunks: deque[bytes] = deque()
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = self.complete = self.closed = self.keep_alive = False

    def begin(self) -> None:
        self.headers = []
        self.head_done = self.complete = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        # Asked here: once the message is complete, llhttp answers False.
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        if self.closed:
            raise ConnectionError("the upstream closed the connection mid-response")
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter
        self.waiter = None


class Pool:
    def __init__(self) -> None:
        self.idle: dict[Address, list[UpstreamConnection]] = {}

    async def acquire(self, address: Address) -> UpstreamConnection:
        idle = self.idle.get(address)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(UpstreamConnection, *address)
        return conn

    def release(self, address: Address, conn: UpstreamConnection) -> None:
        if conn.closed or not conn.keep_alive:
            if conn.transport is not None:
                conn.transport.close()
            return
        self.idle.setdefault(address, []).append(conn)


def _address(url: str) -> tuple[Address, bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    return (host, port), f"{host}:{port}".encode()


class RawFloorProxy:
    def __init__(self, upstreams: dict[str, list[str]]) -> None:
        self.cycles: dict[str, Iterator[tuple[Address, bytes]]] = {
            model: itertools.cycle([_address(u) for u in urls])
            for model, urls in upstreams.items()
            if urls
        }
        self.pool = Pool()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.proxy(scope, receive, send)
        elif scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        model = orjson.loads(body).get("model", ANY_MODEL)
        address, host = next(self.cycles.get(model) or self.cycles[ANY_MODEL])
        conn = await self.pool.acquire(address)
        conn.begin()
        assert conn.transport is not None
        conn.transport.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (scope["raw_path"], host, len(body), body)
        )
        while not conn.head_done:
            await conn.wait()
        headers = [(k, v) for k, v in conn.headers if k.lower() not in RESPONSE_DROP]
        status = conn.parser.get_status_code()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        pending = conn.chunks
        while True:
            if pending:
                chunk = pending.popleft() if len(pending) == 1 else b"".join(pending)
                pending.clear()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            elif conn.complete:
                break
            else:
                await conn.wait()
        self.pool.release(address, conn)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


app = RawFloorProxy(parse_upstreams(os.environ.get("FLOOR_UPSTREAMS", "")))
