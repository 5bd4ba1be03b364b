"""The one failure classifier: what went wrong talking to a worker, whether the request may
go elsewhere, and what the failure counts against the worker.

Every upstream failure the router sees passes through :func:`classify` (an exception
before the answer's head, a status that means "not now, not here", a 5xx relayed, a
stream that broke) and is recorded once, by :class:`FailureLog`: the `upstream_errors`
counter, the worker's ejection count (routing.clients.ejection) and, for failures that
say the server is not there, the passive health report the control plane reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from routing.clients.ejection import Ejector

# Answers that mean "not now, not here": safe to send to another worker before any byte.
RETRY_STATUSES = frozenset({429, 502, 503})
_CAUSE_MAX_CHARS = 500


@dataclass(frozen=True, slots=True)
class Failure:
    """One classified failure.

    `kind`: the upstream_errors label. `reason`: why the request moved on, as the retries
    and fallbacks counters name it. `retryable`: another worker of the same model may take
    it (the connection was never made, or the worker said "not now"); a failure that is not
    may still move on to a fallback model while nothing was sent. `eject`: the cause this
    counts against the worker (None: it does not). `passive`: the server looks absent."""

    kind: str
    reason: str
    retryable: bool
    eject: str | None
    passive: bool = False


def classify(exc: BaseException) -> Failure:
    """A failure before the answer's head arrived."""
    name = type(exc).__name__
    if isinstance(exc, TimeoutError):
        # Only a connection never made is safe to try elsewhere: a worker that took the
        # request and stayed silent may still be generating it.
        connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
        reason = "connect_timeout" if connecting else "timeout"
        return Failure("timeout", reason, connecting, f"timeout: {name}", passive=True)
    # ClientConnectorError: the connection was never made (refused, no route, DNS);
    # anything else failed on a connection that was made (reset, closed, garbled head).
    kind = "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "reset"
    # Only what says "the server is not there": a malformed answer or a bad URL is not
    # something a health check should act on.
    passive = isinstance(exc, aiohttp.ClientConnectionError)
    return Failure(kind, kind, True, f"{kind}: {name}", passive=passive)


def classify_status(status: int) -> Failure | None:
    """An answer's status before it is relayed, when it means "not now, not here"."""
    if status in RETRY_STATUSES:
        eject = f"answered {status}" if status >= 500 else None
        return Failure(f"upstream_{status}", f"status_{status}", True, eject)
    return None


def relayed_status(status: int) -> Failure | None:
    """An answer relayed as it came: a 5xx still counts against its worker."""
    if status >= 500:
        return Failure("upstream_5xx", "upstream_5xx", False, f"answered {status}")
    return None


def broken_stream(exc: BaseException) -> Failure:
    """The answer's stream broke after its head was relayed: nothing can move now."""
    return Failure("broken_stream", "broken_stream", False, f"stream broke: {type(exc).__name__}")


class FailureLog:
    """Records each failure once: counted, held against the worker, reported as passive."""

    def __init__(self, count: Callable[[int, str], None], ejector: Ejector) -> None:
        self._count = count
        self._ejector = ejector
        # worker id -> [failures, last cause]: the server looked absent to real traffic;
        # the refresher takes them for the control plane (take_passive).
        self.passive: dict[int, tuple[int, str]] = {}

    def record(self, worker_id: int, failure: Failure, exc: BaseException | None = None) -> None:
        self._count(worker_id, failure.kind)
        if failure.eject is not None:
            self._ejector.failure(worker_id, failure.eject)
        if failure.passive and exc is not None:
            cause = f"{failure.kind}: {type(exc).__name__}: {exc}"[:_CAUSE_MAX_CHARS]
            count, _ = self.passive.get(worker_id, (0, ""))
            self.passive[worker_id] = (count + 1, cause)

    def take_passive(self) -> dict[int, tuple[int, str]]:
        """The passive failures seen since the last call, as worker id -> (count, cause)."""
        taken, self.passive = self.passive, {}
        return taken
