"""The upstream pool is bounded, and so is the wait for it: with every connection to a
worker in use, a request waits at most CONTROLPANEL_UPSTREAM_POOL_TIMEOUT, then gets a 504
in the OpenAI format (never a hang), and the pool serves again once a connection is free."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from controlpanel.fleet import services
from tests.conftest import StartSimulator, start_router, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "pooled", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


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
        long_stream = {**CHAT, "max_tokens": 25, "stream": True}
        holder = threading.Thread(
            target=lambda: router.post("/v1/chat/completions", json=long_stream), daemon=True
        )
        holder.start()
        wait_until(lambda: sim.state.running == 1)

        started = time.monotonic()
        waited = router.post("/v1/chat/completions", json=CHAT)
        elapsed = time.monotonic() - started
        assert waited.status_code == 504, waited.text
        assert waited.json()["error"]["code"] == 504
        assert 0.4 <= elapsed < 2.5, elapsed

        holder.join(timeout=15)
        assert not holder.is_alive()
        assert router.post("/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: router.get("/health").json()["inflight"] == 0)
    finally:
        stop_process(router.proc)
