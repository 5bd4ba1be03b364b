"""routing.clients.read_timer: aiohttp's sock_read rule, one loop timer per quiet spell."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.client_exceptions import SocketTimeoutError

from routing.clients.read_timer import LazyReadTimeout, install


def handler(timeout: float | None) -> LazyReadTimeout:
    proto = LazyReadTimeout(loop=asyncio.get_running_loop())
    proto.read_timeout = timeout
    return proto


def test_reads_move_the_deadline_without_a_new_timer() -> None:
    async def main() -> None:
        proto = handler(0.2)
        proto.start_timeout()
        first = proto._read_timeout_handle
        for _ in range(100):  # reads in a burst: the one timer stays
            proto._reschedule_timeout()
        assert proto._read_timeout_handle is first and not first.cancelled()
        for _ in range(5):  # a byte every 0.1 s: never 0.2 s quiet
            await asyncio.sleep(0.1)
            proto._reschedule_timeout()
        assert proto.exception() is None
        await asyncio.sleep(0.3)  # then quiet
        assert isinstance(proto.exception(), SocketTimeoutError)
        assert proto._read_timeout_handle is None

    asyncio.run(main())


def test_quiet_for_the_timeout_fails_the_read_as_aiohttp_does() -> None:
    async def main() -> None:
        proto = handler(0.05)
        proto.start_timeout()
        await asyncio.sleep(0.1)
        exc = proto.exception()
        assert isinstance(exc, SocketTimeoutError)
        assert str(exc) == "Timeout on reading data from socket"

    asyncio.run(main())


def test_no_timeout_and_a_drop_stop_the_timer() -> None:
    async def main() -> None:
        proto = handler(None)
        proto.start_timeout()
        assert proto._read_timeout_handle is None
        proto.read_timeout = 0.05
        proto.start_timeout()
        proto._drop_timeout()  # aiohttp's own: end of message, paused reading, an error
        await asyncio.sleep(0.1)
        assert proto.exception() is None

    asyncio.run(main())


def test_installed_only_on_the_pinned_aiohttp(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        connector, other = aiohttp.TCPConnector(), aiohttp.TCPConnector()
        try:
            assert install(connector)
            assert isinstance(connector._factory(), LazyReadTimeout)
            monkeypatch.setattr(aiohttp, "__version__", "0.0")
            assert not install(other)
            assert not isinstance(other._factory(), LazyReadTimeout)
        finally:
            await connector.close()
            await other.close()

    asyncio.run(main())
