"""The probes' one event loop and one HTTP session per process, kept between rounds.

A probe round used to start a new event loop (``asyncio.run``) and a new HTTP client each
time: every round paid for the loop, the client, and a TCP (and TLS) connect per request.
With an idle fleet that set-up was most of the round's CPU. Here both live as long as the
process:

* **One loop.** :func:`run` runs a coroutine on the process's probe loop; between rounds
  the loop is idle and costs nothing (it is not running: no thread, no timer). A lock lets
  one thread at a time use it, since Celery runs tasks on a pool of threads.
* **One** ``aiohttp.ClientSession`` with explicit limits: at most
  ``MAX_CONNECTIONS`` connections, ``CONNECTIONS_PER_HOST`` to each server (a probe asks a
  worker up to four things at once), idle connections kept ``KEEPALIVE_SECONDS`` so the next
  round (CONTROLPANEL_PROBE_INTERVAL later, 5 s by default) reuses them. TLS is verified
  with the process's one context (``probes.tls_context``, passed in), as every call to a worker is.
  No session-wide timeout: each request is bounded by the caller's deadline.
* **Per process, not per module.** Both are remembered with the pid that made them; a forked
  child (Celery's prefork pool) starts its own rather than share its parent's sockets.
  At exit the session is closed and the loop with it.

Only the Celery worker (and commands that probe) loads this: the router imports
``probes`` for ``worker_auth`` and must not start a loop or load this module.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import ssl
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

# A probed worker holds up to four connections at once (/health, /metrics, /v1/models and
# its DCGM exporter), and probes.MAX_CONCURRENT_WORKERS (128) are probed at the same moment.
# (Numbers, not imports: probes loads this module, never the other way round.)
CONNECTIONS_PER_HOST = 4
MAX_CONNECTIONS = 128 * CONNECTIONS_PER_HOST
# Longer than the default probe interval (5 s), so a round finds the last round's
# connections; a server that closes them sooner (uvicorn's 5 s default, vLLM's) costs a
# reconnect, as before.
KEEPALIVE_SECONDS = 30.0


@dataclass
class _Probing:
    pid: int
    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession | None = None  # made inside the loop, on first use


_lock = threading.Lock()
_current: _Probing | None = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on this process's probe loop."""
    with _lock:
        return _probing().loop.run_until_complete(coro)


async def session(*, tls: ssl.SSLContext) -> aiohttp.ClientSession:
    """The process's probe session; call it from a coroutine given to :func:`run`. `tls`
    verifies HTTPS workers (the process's one context: the first call's is kept)."""
    probing = _probing()
    if probing.session is None or probing.session.closed:
        connector = aiohttp.TCPConnector(
            limit=MAX_CONNECTIONS,
            limit_per_host=CONNECTIONS_PER_HOST,
            keepalive_timeout=KEEPALIVE_SECONDS,
            ssl=tls,
        )
        probing.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        )
    return probing.session


def _probing() -> _Probing:
    """This process's loop; a new one after a fork (the parent's belongs to the parent)."""
    global _current
    if _current is None or _current.pid != os.getpid():
        # A forked child drops its parent's loop and session unclosed: closing them here
        # would send nothing, and their sockets are the parent's to use.
        _current = _Probing(pid=os.getpid(), loop=asyncio.new_event_loop())
    return _current


def close() -> None:
    """Close the session and the loop (at exit; a later :func:`run` starts new ones)."""
    global _current
    with _lock:
        probing, _current = _current, None
        if probing is None or probing.pid != os.getpid():
            return
        if probing.session is not None:
            probing.loop.run_until_complete(probing.session.close())
        probing.loop.run_until_complete(probing.loop.shutdown_asyncgens())
        probing.loop.close()


atexit.register(close)
