"""Graceful shutdown: on SIGTERM the router stops accepting, lets open streams finish."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.support.servers import AddWorker, StartSimulator, start_router, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_sigterm_lets_an_open_stream_finish(
    var_dir: Path, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m", itl_ms=100)
    add_worker(sim)
    router = start_router(var_dir)
    lines: list[str] = []

    def stream() -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 25, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    try:
        wait_until(lambda: "m" in router.get("/list_models").json()["models"])
        streamer = threading.Thread(target=stream)
        streamer.start()
        wait_until(lambda: sim.state.running == 1)
        router.proc.terminate()
        wait_until(lambda: _refused(router.url))  # no longer accepting
        streamer.join(timeout=30)
        # uvicorn re-raises the SIGTERM once it has shut down cleanly.
        assert router.proc.wait(timeout=30) in (0, -15)
    finally:
        stop_process(router.proc)
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 26  # every token, then [DONE]: nothing cut short


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False
