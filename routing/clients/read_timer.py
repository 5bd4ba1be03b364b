"""sock_read, the upstream read timeout, with one timer per quiet spell instead of one per read.

aiohttp's ResponseHandler restarts its read timer on every socket read (``data_received``):
it cancels a loop timer and schedules a new one, about 3 µs a read, which on a 64-token
stream was most of what the router spent per request beyond the floor proxy (bench/RESULTS.md,
#29). :class:`LazyReadTimeout` keeps aiohttp's rule, that a read times out when no byte came
for ``sock_read`` seconds, but a read only moves the deadline forward; the one timer, when it
fires, either finds the deadline still ahead (bytes came since) and waits for the rest, or
fails the read exactly as aiohttp does (``_on_read_timeout``). Where aiohttp stops the timer
(paused reading, end of message, an error) it still does, through its own ``_drop_timeout``.

It overrides a private method of aiohttp's, so it is installed only on the aiohttp version it
was written for (pyproject pins it) and the stock handler is kept on any other.
"""

from __future__ import annotations

import asyncio
import functools

import aiohttp
from aiohttp.client_proto import ResponseHandler

WRITTEN_FOR = "3.14.5"


class LazyReadTimeout(ResponseHandler):
    _read_deadline = 0.0  # loop time by which the next byte must have come

    def _reschedule_timeout(self) -> None:
        timeout = self._read_timeout
        if not timeout:
            self._drop_timeout()
            return
        loop = self._loop
        self._read_deadline = loop.time() + timeout
        if self._read_timeout_handle is None:
            self._read_timeout_handle = loop.call_at(self._read_deadline, self._read_timer_fired)

    def _read_timer_fired(self) -> None:
        loop = self._loop
        if loop.time() < self._read_deadline:  # bytes came since it was set: wait the rest
            self._read_timeout_handle = loop.call_at(self._read_deadline, self._read_timer_fired)
            return
        self._read_timeout_handle = None
        self._on_read_timeout()


def _handler(loop: asyncio.AbstractEventLoop) -> ResponseHandler:
    return LazyReadTimeout(loop=loop)


def install(connector: aiohttp.TCPConnector) -> bool:
    """Make `connector`'s new connections use LazyReadTimeout; False (and nothing changed)
    on an aiohttp other than the one it was written for."""
    if aiohttp.__version__ != WRITTEN_FOR:
        return False
    connector._factory = functools.partial(_handler, loop=connector._loop)
    return True
