"""The one failure classifier (routing.clients.failures): real aiohttp failures against
local sockets, what each lets the request do, and what it counts against the worker."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from routing.clients.ejection import Ejector
from routing.clients.failures import (
    Failure,
    FailureLog,
    broken_stream,
    classify,
    classify_status,
    relayed_status,
)


async def failure_of(port: int, *, read_timeout: float | None = None) -> BaseException:
    timeout = aiohttp.ClientTimeout(total=30, sock_read=read_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.get(f"http://127.0.0.1:{port}/v1/models"):
                pass
        except (aiohttp.ClientError, TimeoutError) as exc:
            return exc
    raise AssertionError("the request did not fail")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refused_connection_may_go_to_another_worker_and_looks_absent() -> None:
    exc = asyncio.run(failure_of(closed_port()))
    assert classify(exc) == Failure(
        "connect", "connect", True, f"connect: {type(exc).__name__}", passive=True
    )


def test_a_connection_closed_before_the_head_is_a_reset() -> None:
    async def scenario() -> BaseException:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        async with server:
            return await failure_of(server.sockets[0].getsockname()[1])

    failure = classify(asyncio.run(scenario()))
    assert (failure.kind, failure.retryable, failure.passive) == ("reset", True, True)
    assert failure.eject == "reset: ServerDisconnectedError"


def test_a_worker_silent_after_taking_the_request_is_not_retried() -> None:
    """It may still be generating the answer: only a connection never made moves on."""

    async def scenario() -> BaseException:
        done = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await done.wait()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        async with server:
            try:
                return await failure_of(server.sockets[0].getsockname()[1], read_timeout=0.2)
            finally:
                done.set()

    failure = classify(asyncio.run(scenario()))
    assert (failure.kind, failure.reason, failure.retryable) == ("timeout", "timeout", False)
    connecting = classify(aiohttp.ConnectionTimeoutError("connect"))
    assert (connecting.reason, connecting.retryable, connecting.passive) == (
        "connect_timeout",
        True,
        True,
    )


def test_a_garbled_answer_is_not_a_reason_for_the_health_check() -> None:
    failure = classify(aiohttp.ClientPayloadError("bad chunk"))
    assert (failure.kind, failure.retryable, failure.passive) == ("reset", True, False)


@pytest.mark.parametrize(
    ("status", "reason", "eject"),
    [
        (429, "status_429", None),
        (502, "status_502", "answered 502"),
        (503, "status_503", "answered 503"),
    ],
)
def test_not_now_not_here_statuses_move_on_and_only_5xx_count_against(
    status: int, reason: str, eject: str | None
) -> None:
    failure = classify_status(status)
    assert failure is not None and failure.retryable
    assert (failure.reason, failure.eject) == (reason, eject)


def test_other_statuses_are_relayed_and_a_relayed_5xx_still_counts() -> None:
    assert classify_status(500) is None and classify_status(400) is None
    assert relayed_status(404) is None
    failure = relayed_status(500)
    assert failure == Failure("upstream_5xx", "upstream_5xx", False, "answered 500")
    broke = broken_stream(ConnectionResetError("peer"))
    assert (broke.retryable, broke.eject) == (False, "stream broke: ConnectionResetError")


def test_the_log_counts_once_ejects_and_hands_passive_failures_over_once() -> None:
    counted: list[tuple[int, str]] = []
    ejector = Ejector(threshold=2, base_cooldown=5)
    log = FailureLog(lambda worker, kind: counted.append((worker, kind)), ejector)
    refused = ConnectionRefusedError("refused")
    log.record(
        1, classify(aiohttp.ClientConnectionError("gone")), aiohttp.ClientConnectionError("gone")
    )
    log.record(1, Failure("connect", "connect", True, "connect: x", passive=True), refused)
    log.record(2, classify_status(429))  # type: ignore[arg-type]
    assert counted == [(1, "reset"), (1, "connect"), (2, "upstream_429")]
    assert set(ejector.ejected_until) == {1}  # a 429 is not held against worker 2
    assert log.take_passive() == {1: (2, "connect: ConnectionRefusedError: refused")}
    assert log.take_passive() == {}


def test_a_passive_cause_is_cut_to_a_readable_length() -> None:
    log = FailureLog(lambda worker, kind: None, Ejector())
    log.record(
        3, classify(aiohttp.ClientConnectionError()), aiohttp.ClientConnectionError("x" * 2000)
    )
    ((count, cause),) = log.take_passive().values()
    assert count == 1 and len(cause) == 500 and cause.startswith("reset: ClientConnectionError: x")
