"""The stack floor: the least a proxy built on uvicorn + aiohttp can cost on this machine.

``bench.overhead`` runs this module next to the router, with the same uvicorn command line
(``python -m uvicorn bench.common.floor_proxy:app --host ... --port ... --lifespan on
--no-access-log``), and measures its CPU per request from ``/proc`` exactly as it measures the
router's. It is built from the same parts as the router's hot path and nothing else:

* a bare ASGI app (no Django, no routing table, no policy, no in-flight counting, no
  disconnect watcher, no error handling beyond what uvicorn does on its own);
* one long-lived ``aiohttp.ClientSession`` made at lifespan start-up, with a
  ``TCPConnector`` with a large limit, ``auto_decompress=False``, no automatic request headers
  and a dummy cookie jar (as the router's session), and no timeouts at all (the router arms
  connect and read timers);
* per request: read the body, parse it once with orjson to learn ``model`` (the router does
  the same, so the parse is part of the floor), ``POST`` the untouched bytes to the next
  upstream of that model in round-robin order, relay the status and the raw response headers
  (minus hop-by-hop headers and ``date``/``server``, which uvicorn writes itself), then every
  body chunk as ``content.readany()`` returns it. The client's request headers are not
  relayed; only ``Content-Type: application/json`` is sent.

So "router CPU per request minus floor CPU per request" in the same run is what the router's
own code costs (snapshot lookup, policy, counters, header copying, the disconnect watcher,
timeouts, the path dispatch in ``controlpanel.asgi`` ahead of it, its background work); the
floor itself is what uvicorn's HTTP server plus aiohttp's client cost per proxied request,
which no router on this stack can go below. One caveat: the floor does not tune the garbage
collector as the router does (``gc.freeze()`` and a higher young-generation threshold), so
on that count alone the router can be a little cheaper than the floor.

``bench.routing`` also sends its oracle's assignment through this proxy (its
``floor_oracle`` mode): a path ``/upstream/<i>/v1/...`` is forwarded as ``/v1/...`` to
upstream *i* (from 0, in ``FLOOR_UPSTREAMS`` order) of the request's model instead of the next
one in turn. That costs one ``str.startswith`` per request, and no router can pick a worker
for less.

Configuration, from the environment:

``FLOOR_UPSTREAMS``
    ``model=URL,URL,...;model=URL,...``: base URLs (``http://127.0.0.1:8001``) per model name.
    An entry without ``model=`` serves every model not listed. A request for a model with no
    upstream fails (uvicorn answers 500).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import aiohttp
import orjson

from routing.asgi_types import Receive, Scope, Send

# The router's own list, so the floor relays exactly the headers the router relays.
from routing.relay import RESPONSE_DROP

ANY_MODEL = ""
PIN = "/upstream/"  # /upstream/<i>/...: to upstream i (bench.routing)
MAX_CONNECTIONS = 2048
REQUEST_HEADERS = {"Content-Type": "application/json"}


def parse_upstreams(spec: str) -> dict[str, list[str]]:
    """``"m1=u1,u2;m2=u3"`` -> ``{"m1": [u1, u2], "m2": [u3]}``; no ``m=`` means any model."""
    upstreams: dict[str, list[str]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        head, sep, tail = entry.partition("=")
        model, urls = (head.strip(), tail) if sep and "://" not in head else (ANY_MODEL, entry)
        upstreams[model] = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
    if not any(upstreams.values()):
        raise ValueError("FLOOR_UPSTREAMS names no upstream")
    return upstreams


class FloorProxy:
    def __init__(self, upstreams: dict[str, list[str]]) -> None:
        self.upstreams = upstreams
        self.cycles: dict[str, Iterator[str]] = {
            model: itertools.cycle(urls) for model, urls in upstreams.items() if urls
        }
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.proxy(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, limit_per_host=0),
                    timeout=aiohttp.ClientTimeout(total=None),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
                    cookie_jar=aiohttp.DummyCookieJar(),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        model = orjson.loads(body).get("model", ANY_MODEL)
        # An unknown model raises KeyError, which uvicorn answers with a 500.
        cycle = self.cycles.get(model) or self.cycles[ANY_MODEL]
        assert self.session is not None, "uvicorn must run with --lifespan on"
        path = scope["path"]
        if path.startswith(PIN):
            index, _, rest = path.removeprefix(PIN).partition("/")
            url = (self.upstreams.get(model) or self.upstreams[ANY_MODEL])[int(index)] + "/" + rest
        else:
            url = next(cycle) + path
        async with self.session.post(url, data=body, headers=REQUEST_HEADERS) as upstream:
            headers = [(k, v) for k, v in upstream.raw_headers if k.lower() not in RESPONSE_DROP]
            await send(
                {"type": "http.response.start", "status": upstream.status, "headers": headers}
            )
            content = upstream.content
            while chunk := await content.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


app = FloorProxy(parse_upstreams(os.environ.get("FLOOR_UPSTREAMS", "")))
