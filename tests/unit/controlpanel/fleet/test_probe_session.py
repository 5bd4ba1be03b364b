"""The probes' loop and HTTP session (controlpanel.fleet.probe_session): one per process,
kept between rounds, connections reused, new ones after a fork, closed at exit."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from controlpanel.fleet import probe_session, probes


@pytest.fixture(autouse=True)
def fresh_session() -> Iterator[None]:
    probe_session.close()
    yield
    probe_session.close()


async def _current() -> tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession]:
    return asyncio.get_running_loop(), await probe_session.session(tls=probes.tls_context())


def test_rounds_share_one_loop_and_one_session() -> None:
    first = probe_session.run(_current())
    second = probe_session.run(_current())
    assert first == second
    assert first[1].connector is not None and first[1].connector.limit_per_host == 4


def test_the_limits_cover_a_full_round() -> None:
    per_round = probes.MAX_CONCURRENT_WORKERS * probe_session.CONNECTIONS_PER_HOST
    assert per_round == probe_session.MAX_CONNECTIONS


def test_a_forked_child_starts_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    parents = probe_session.run(_current())
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as after a fork
    childs = probe_session.run(_current())
    assert childs[0] is not parents[0] and childs[1] is not parents[1]
    assert not parents[1].closed  # the parent's to close, not the child's


def test_close_closes_the_session() -> None:
    _, session = probe_session.run(_current())
    probe_session.close()
    assert session.closed
    assert probe_session.run(_current())[1] is not session  # a later round starts anew


def test_a_second_round_reuses_the_first_rounds_connections() -> None:
    peers: set[int] = set()

    async def serve() -> web.AppRunner:
        async def health(request: web.Request) -> web.Response:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            peers.add(peer[1] if peer else 0)
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = probe_session.run(serve())
    port = runner.addresses[0][1]
    try:
        target = probes.ProbeTarget(worker_id=1, url=f"http://127.0.0.1:{port}", read_models=False)
        for _ in range(3):
            (result,) = probes.probe_many([target], timeout=5)
            assert result.up and result.metrics_text == "ok"
    finally:
        probe_session.run(runner.cleanup())
    assert len(peers) <= 2  # /health and /metrics side by side, then the same two again
