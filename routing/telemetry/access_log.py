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
the client asked for to it (routing.fleet.fallbacks), null for a request that made none.
`session` is the request's session (routing.sessions) as a hash of its key and the header
it came from, null for a request without one. `cache` is a cache-aware policy's prediction of
the prompt tokens the worker held, beside what the worker reported (routing.telemetry.cache_check),
so
an operator can find the requests whose prediction was wrong; null where none was checked.

Where the lines go is logging's business (settings.LOGGING: stderr or a file). `SampleFilter`
keeps a share of the successful requests' lines and every other one, for a busy router or
a demo whose console should show operators' events rather than every request.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any, cast

import orjson

from routing.telemetry import explain
from routing.telemetry.access_writer import BatchedHandler
from routing.telemetry.counters import CLIENT_CLOSED

if TYPE_CHECKING:
    from routing.exchange import Exchange

HEADER = b"x-request-id"
MAX_REQUEST_ID = 128
log = logging.getLogger("routing.access")


def request_id(ex: Exchange) -> bytes:
    """The request's id, also set on `ex`; a made-up one is added to the headers that go
    upstream."""
    scope = ex.scope
    headers = scope["headers"]
    found: bytes | None = None
    for name, value in headers:
        if name == HEADER:
            found = value
        elif name == explain.HEADER and explain.wanted(value):
            # The one pass over the client's headers also notes an explain request, so
            # a request that asks for none costs nothing more (routing.telemetry.explain).
            ex.explain_asked = True
    if found is not None:
        if _sensible(found):
            ex.request_id = bytes(found)
            return ex.request_id
        headers = [(n, v) for n, v in headers if n != HEADER]
    made = _new_id()
    scope["headers"] = [*headers, (HEADER, made)]
    ex.request_id = made
    return made


# New ids are drawn from os.urandom 64 at a time: one getrandom system call per 64 requests
# instead of one per request (#29); the same 128 random bits per id.
_ID_BATCH = 64
_ids: list[bytes] = []
os.register_at_fork(after_in_child=_ids.clear)  # a child must not repeat its parent's ids


def _new_id() -> bytes:
    if not _ids:
        drawn = os.urandom(16 * _ID_BATCH).hex().encode()
        _ids.extend(drawn[i : i + 32] for i in range(0, len(drawn), 32))
    return _ids.pop()


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def write(trace: Exchange, worker: str) -> None:
    """One line per request, at its end (callers ask enabled() first, as log.info would)."""
    scope, key = trace.scope, trace.client
    first_byte = trace.first_byte
    line = {
        "ts": round(time.time(), 3),
        "request_id": trace.request_id.decode("ascii"),
        "method": scope["method"],
        "path": scope["path"],
        "model": trace.model or None,
        "worker": worker or None,
        "status": trace.status or CLIENT_CLOSED,
        "duration_ms": round((perf_counter() - trace.started) * 1000, 2),
        "ttft_ms": None if first_byte is None else round((first_byte - trace.started) * 1000, 2),
        "key": None if key is None else key.prefix,
        "fallbacks": trace.hops or None,  # [{"from", "to", "reason"}], or null
        "pinned": trace.pinned_shown,  # {"response_id", "found_in", ...}, or null
        # routing.sessions: {"hash", "from"}, never the key itself; null without a session.
        "session": None if trace.session is None else trace.session.shown(),
        # routing.telemetry.cache_check: what a cache-aware policy predicted the worker's prefix
        # cache
        # held of this prompt and what it reported ({"decision", "predicted", "reported",
        # "block_size"}, tokens); null when nothing was checked.
        "cache": trace.cache,
        # routing.pd: the prefill leg's worker, decision, attempts and ms, or its bypass.
        "pd": None if trace.pd is None else _pd_shown(trace.pd),
    }
    message = orjson.dumps(line).decode()
    status = line["status"]
    if (handler := direct_handler()) is not None:
        for sample in handler.filters:  # SampleFilters only (direct_handler)
            if not cast(SampleFilter, sample).keeps(status):
                return
        handler.add_line(message)
        return
    if logging.getLogRecordFactory() is not logging.LogRecord:  # someone's own records
        log.info(message, extra={"status": status})
        return
    log.handle(_record(message, status))


def direct_handler() -> BatchedHandler | None:
    """The access log's handler when logging would only pass a finished line on to it:
    settings.LOGGING's set-up, where the logger has no filter, does not propagate, and has
    one batched handler (routing.telemetry.access_writer) that formats `%(message)s` alone
    and filters by SampleFilter only. write() then hands the line over itself, without a
    record and the dozen calls of logging's handle, filters and formatting (about 20 calls
    a request, #29). Any other set-up (a test's handler, an operator's own LOGGING) gets
    the line through logging as before. Asked at every line: LOGGING may change at run time.
    """
    if log.filters or log.propagate or len(log.handlers) != 1:
        return None
    handler = log.handlers[0]
    if not isinstance(handler, BatchedHandler) or handler.level > logging.INFO:
        return None
    formatter = handler.formatter
    if type(formatter) is not logging.Formatter or formatter._fmt != _MESSAGE_ONLY:
        return None
    for kept in handler.filters:
        if type(kept) is not SampleFilter:
            return None
    return handler


_MESSAGE_ONLY = "%(message)s"


def _pd_shown(pd: dict[str, Any]) -> dict[str, Any]:
    shown = {k: v for k, v in pd.items() if k not in ("prefill_seconds", "prefilled_at")}
    if "prefill_seconds" in pd:
        shown["prefill_ms"] = round(pd["prefill_seconds"] * 1000, 2)
    return shown


class SampleFilter(logging.Filter):
    """Keeps `share` (0 to 1) of the lines of requests answered below 400, and all others:
    a failure is the line somebody will look for."""

    def __init__(self, share: float = 1.0) -> None:
        super().__init__()
        self.share = share

    def filter(self, record: logging.LogRecord) -> bool:
        return self.keeps(getattr(record, "status", None))

    def keeps(self, status: object) -> bool:
        if self.share >= 1 or not isinstance(status, int) or status >= 400:
            return True
        return random.random() < self.share


def _sensible(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.decode().isprintable()


# logging's own record costs a stack walk (findCaller) and a dozen calls (LogRecord.__init__:
# basename, splitext, getpid, the process and thread names) on every request, a tenth of the
# router's own CPU per request (bench/RESULTS.md, #29). A line's record differs from the last
# only in its message, time, status and thread: the rest is worked out once per process (again
# after a fork) by LogRecord itself, for the line in write() that makes the record, and the
# record goes to the logger's handle() as log.info's would (filters, handlers, propagation).
_fields: dict[str, Any] = {}
os.register_at_fork(after_in_child=_fields.clear)  # a child's pid and process name differ


def _constant_fields() -> dict[str, Any]:
    if not _fields:
        caller = sys._getframe(2)  # write(), through _record()
        code = caller.f_code
        model = logging.LogRecord(
            log.name, logging.INFO, code.co_filename, caller.f_lineno, "", None, None,
            code.co_name,
        )  # fmt: skip
        _fields.update(model.__dict__)
        for varying in ("msg", "created", "msecs", "relativeCreated", "thread", "threadName"):
            del _fields[varying]
    return _fields


def _record(message: str, status: int) -> logging.LogRecord:
    record = logging.LogRecord.__new__(logging.LogRecord)
    fields = record.__dict__
    fields.update(_constant_fields())
    now = time.time()
    fields["msg"] = message
    fields["status"] = status  # the `extra` SampleFilter reads
    fields["created"] = now
    fields["msecs"] = int((now - int(now)) * 1000) + 0.0
    fields["relativeCreated"] = (now - logging._startTime) * 1000  # type: ignore[attr-defined]
    if logging.logThreads:
        fields["thread"] = threading.get_ident()
        fields["threadName"] = threading.current_thread().name
    else:
        fields["thread"] = fields["threadName"] = None
    return record  # Python 3.11 (pyproject): no taskName yet
