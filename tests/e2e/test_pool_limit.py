"""The upstream pool is bounded, and so is the wait for it: with every connection to a
worker in use, a request waits at most CONTROLPANEL_UPSTREAM_POOL_TIMEOUT, then gets a 504
in the OpenAI format (never a hang), and the pool serves again once a connection is free."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from controlpanel.fleet import services
from tests.support.servers import (
    WAIT_CEILING_S,
    RouterServer,
    StartSimulator,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "pooled", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def hold_the_connection(router: RouterServer, release: threading.Event) -> None:
    """A stream of up to 400 s that holds the pool's one connection until `release`."""
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=body, timeout=WAIT_CEILING_S
    ) as response:
        for _ in response.iter_lines():
            if release.is_set():
                break


def test_a_request_waits_for_a_full_pool_only_so_long(
    tmp_path: Path, simulator: StartSimulator
) -> None:
    router = start_router(
        tmp_path,
        CONTROLPANEL_UPSTREAM_MAX_CONNECTIONS_PER_WORKER="1",
        CONTROLPANEL_UPSTREAM_POOL_TIMEOUT="0.5",
        CONTROLPANEL_EJECT_AFTER="0",  # this test is about the pool, not ejection
    )
    try:
        sim = simulator("pooled", itl_ms=100)
        router.wait_routable(services.worker_add(url=sim.url, actor="test"))
        release = threading.Event()
        holder = threading.Thread(target=hold_the_connection, args=(router, release))
        holder.start()
        wait_until(lambda: sim.state.running == 1)

        started = time.monotonic()
        try:
            waited = router.post("/v1/chat/completions", json=CHAT)
        finally:
            elapsed = time.monotonic() - started
            release.set()
        # Answered while the one connection was still held (until `release`): the wait for
        # the pool ended by itself, after its 0.5 s, not when the connection came back.
        assert waited.status_code == 504, waited.text
        assert waited.json()["error"]["code"] == 504
        assert elapsed >= 0.4, elapsed

        holder.join(timeout=WAIT_CEILING_S)
        assert not holder.is_alive()
        assert router.post("/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: router.get("/health").json()["inflight"] == 0)
    finally:
        stop_process(router.proc)
