"""Request IDs and the router's structured access log.

Every request the router answers gets an id: the client's `X-Request-ID` when it sent a
sensible one (up to MAX_REQUEST_ID printable ASCII characters), otherwise a new random one.
On the model routes the id is forwarded to the worker (vLLM names its own request after it);
on every route, model routes, /v1/models, the seed listings, /health, /metrics and the
router's own 401s, 404s and 405s alike, it is returned in the answer's `X-Request-ID` and
written in the access log: one JSON object per request, on the `routing.access` logger, with
what happened and never with what was asked: no prompt text, and of the client's key only
its public prefix. `model` and `worker` are null where there is none, as on /health;
`model` is the served model that answered, and `fallbacks` lists the moves from the name
the client asked for to it (routing.fallbacks), null for a request that made none.
`session` is the request's session (routing.sessions) as a hash of its key and the header
it came from, null for a request without one. `cache` is a cache-aware policy's prediction of
the prompt tokens the worker held, beside what the worker reported (routing.cache_check), so
an operator can find the requests whose prediction was wrong; null where none was checked.

Where the lines go is logging's business (settings.LOGGING: stderr or a file). `SampleFilter`
keeps a share of the successful requests' lines and every other one, for a busy router or
a demo whose console should show operators' events rather than every request.
"""

from __future__ import annotations

import logging
import os
import random
import time
from time import perf_counter

import orjson

from routing import explain, fallbacks
from routing.asgi_types import Scope
from routing.auth import SCOPE_KEY
from routing.metrics import CLIENT_CLOSED, RequestTrace

HEADER = b"x-request-id"
# routing.response_affinity: the response id a request was pinned by, and how it was found.
PINNED_SCOPE_KEY = "controlpanel.pinned"
MAX_REQUEST_ID = 128
log = logging.getLogger("routing.access")


def request_id(scope: Scope) -> bytes:
    """The request's id; a made-up one is added to the headers that go upstream."""
    headers = scope["headers"]
    found: bytes | None = None
    for name, value in headers:
        if name == HEADER:
            found = value
        elif name == explain.HEADER and explain.wanted(value):
            # The one pass over the client's headers also notes an explain request, so
            # a request that asks for none costs nothing more (routing.explain).
            scope[explain.SCOPE_KEY] = True
    if found is not None:
        if _sensible(found):
            return bytes(found)
        headers = [(n, v) for n, v in headers if n != HEADER]
    made = os.urandom(16).hex().encode()
    scope["headers"] = [*headers, (HEADER, made)]
    return made


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def write(scope: Scope, trace: RequestTrace, rid: bytes, worker: str) -> None:
    """One line per request, at its end."""
    key = scope.get(SCOPE_KEY)
    first_byte = trace.first_byte
    line = {
        "ts": round(time.time(), 3),
        "request_id": rid.decode("ascii"),
        "method": scope["method"],
        "path": scope["path"],
        "model": trace.model or None,
        "worker": worker or None,
        "status": trace.status or CLIENT_CLOSED,
        "duration_ms": round((perf_counter() - trace.started) * 1000, 2),
        "ttft_ms": None if first_byte is None else round((first_byte - trace.started) * 1000, 2),
        "key": None if key is None else key.prefix,
        "fallbacks": fallbacks.hops_of(scope),  # [{"from", "to", "reason"}], or null
        "pinned": scope.get(PINNED_SCOPE_KEY),  # {"response_id", "found_in", ...}, or null
        # routing.sessions: {"hash", "from"}, never the key itself; null without a session.
        "session": None if trace.session is None else trace.session.shown(),
        # routing.cache_check: what a cache-aware policy predicted the worker's prefix cache
        # held of this prompt and what it reported ({"decision", "predicted", "reported",
        # "block_size"}, tokens); null when nothing was checked.
        "cache": trace.cache,
    }
    log.info(orjson.dumps(line).decode(), extra={"status": line["status"]})


class SampleFilter(logging.Filter):
    """Keeps `share` (0 to 1) of the lines of requests answered below 400, and all others:
    a failure is the line somebody will look for."""

    def __init__(self, share: float = 1.0) -> None:
        super().__init__()
        self.share = share

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status", None)
        if self.share >= 1 or not isinstance(status, int) or status >= 400:
            return True
        return random.random() < self.share


def _sensible(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.decode().isprintable()
