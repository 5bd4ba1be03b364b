"""The end-to-end tier's own fixtures: router processes of a test's own that share Redis, a
server that resets every connection, and the health probes' settings. The router, the OpenAI
client on it, the simulators and Celery are fixtures of tests/conftest.py (the browser and
real-vLLM tiers use them too)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pytest_django.fixtures import Settings as SettingsWrapper

from tests.support.common import REDIS_URL
from tests.support.servers import RouterServer, start_router, stop_process


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Callable[..., list[RouterServer]]]:
    """routers(count, **env) starts router processes of the test's own, on REDIS_URL's Redis
    unless told otherwise; they stop when the test ends."""
    started: list[RouterServer] = []

    def start(count: int, **env: str) -> list[RouterServer]:
        env.setdefault("REDIS_URL", REDIS_URL)
        fresh = [start_router(tmp_path, **env) for _ in range(count)]
        started.extend(fresh)
        return fresh

    yield start
    for router in started:
        stop_process(router.proc)


@pytest.fixture
def resetting_server() -> Iterator[str]:
    """Accepts a connection, reads the request, then closes without answering."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.recv(65536)
            conn.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def probe_settings(settings: SettingsWrapper) -> SettingsWrapper:
    """The health probes' timeout, thresholds and intervals of tests/e2e/test_probes.py and
    test_probe_exports.py: three failures to unhealthy, two successes back, and a timeout
    that a worker answering at once meets however busy the machine is (a probe that times
    out is a failure, which would change what these tests count); the hanging workers'
    test sets its own."""
    settings.CONTROLPANEL_PROBE_TIMEOUT = 10.0
    settings.CONTROLPANEL_UNHEALTHY_AFTER = 3
    settings.CONTROLPANEL_HEALTHY_AFTER = 2
    settings.CONTROLPANEL_MODELS_EVERY = 6
    settings.CONTROLPANEL_HISTORY_MINUTES = 30
    return settings
