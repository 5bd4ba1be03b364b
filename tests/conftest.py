"""End-to-end fixtures: the real ASGI server (uvicorn) in a subprocess on the test database,
simulated vLLM workers on their own ports, and helpers to wait for the router to see them.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection
from django.test import TransactionTestCase

from controlpanel.fleet import services
from controlpanel.registry.models import RoutingGeneration, Worker
from simulator.config import SimConfig
from simulator.server import RunningSimulator, start_simulator

ROOT = Path(__file__).resolve().parent.parent
# The real-vLLM tier (tests/realvllm) starts real vLLM servers: collected only when asked
# for (make test-real-vllm, .ci/run), where nothing in it may skip.
REAL_VLLM = os.environ.get("CONTROLPANEL_REAL_VLLM") == "1"
collect_ignore_glob = [] if REAL_VLLM else ["realvllm/*"]
# Tests that need a real Redis skip without one in `make test`; CI's second tier has one and
# turns any skip into a failure (CONTROLPANEL_TESTS_NO_SKIP, pytest_runtest_makereport below).
REDIS_URL = os.environ.get("REDIS_URL", "")
needs_redis = pytest.mark.skipif(
    not REDIS_URL, reason="needs REDIS_URL (the second CI tier runs it against a real Redis)"
)
ADMIN_HEADERS = {"Authorization": f"Bearer {settings.CONTROLPANEL_ADMIN_TOKEN}"}
AGENT_HEADERS = {"Authorization": f"Bearer {settings.CONTROLPANEL_WORKER_TOKEN}"}


_flush_tables = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]


def _flush_tables_retrying(self: TransactionTestCase) -> None:
    """A transactional test's teardown truncates every table while the session's router
    may be writing its report (several tables in one transaction): PostgreSQL can then
    break the deadlock by failing the TRUNCATE. That is the suite's race, not the code's,
    so the flush is tried again."""
    for attempt in range(3):
        try:
            _flush_tables(self)
            return
        except CommandError as exc:
            if attempt == 2 or "deadlock" not in str(exc.__cause__):
                raise
            time.sleep(0.5)


TransactionTestCase._fixture_teardown = _flush_tables_retrying  # type: ignore[attr-defined]


_RESERVED_LOW, _RESERVED_BAND = 20_000, 3_000  # 20000-31999: below the ephemeral range


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are chosen, since two
    `free_port()` calls in a row can return the same port."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port_run(n: int) -> int:
    """The first of `n` consecutive free ports, for a subprocess that binds them seconds
    later (`serve --port`, `--demo-base-port`). Taken below the kernel's ephemeral range
    (ip_local_port_range), where no `bind(0)` and no outgoing connection of another test can
    take them meanwhile (one did: "address already in use" for a demo engine); each xdist
    worker draws from a band of its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    band = int(worker) if worker.isdigit() else 0
    low = _RESERVED_LOW + (band % 4) * _RESERVED_BAND
    for _ in range(200):
        base = random.randrange(low, low + _RESERVED_BAND - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {n} free ports found")


def test_database_url() -> str:
    """The URL of the database pytest-django created, for subprocesses to share it."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgresql://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def subprocess_env(var_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": test_database_url(),
        "CONTROLPANEL_VAR_DIR": str(var_dir),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


# A condition's ceiling, not a wait: generous, since a loaded 2-core machine (load 20 and
# more beside real vLLM or a benchmark) stretches what takes 100 ms when idle past 10 s.
WAIT_CEILING_S = 30.0


def wait_until(
    predicate: Callable[[], Any], *, timeout: float = WAIT_CEILING_S, interval: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last value: {last!r})")


def stop_process(proc: subprocess.Popen[bytes], *, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the router ---------------------------------------------------------------------------


@dataclass
class RouterServer:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=10, **kwargs)

    def workers(self) -> dict[int, dict[str, Any]]:
        return {w["id"]: w for w in self.get("/list_workers").json()["workers"]}

    def wait_for(self, predicate: Callable[[dict[int, dict[str, Any]]], bool]) -> None:
        """Wait until the router's view satisfies the predicate; a worker the router does
        not know yet (KeyError) just means "not yet"."""

        def check() -> bool:
            try:
                return predicate(self.workers())
            except KeyError:
                return False

        wait_until(check)

    def wait_snapshot(self) -> None:
        """Until the router routes with every change committed so far (a slow machine may
        take longer than one poll)."""
        changed = RoutingGeneration.current()
        wait_until(lambda: int(self.get("/health").json()["snapshot_generation"]) >= changed)

    def wait_routable(self, *workers: Worker) -> None:
        ids = {w.pk for w in workers}
        self.wait_for(lambda seen: all(seen.get(i, {}).get("routable") for i in ids))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_router(var_dir: Path, port: int | None = None, **env: str) -> RouterServer:
    port = port or free_port()
    log_path = var_dir / f"router-{port}.log"
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "controlpanel.asgi:application",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--lifespan",
        "on",
        "--no-access-log",
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=subprocess_env(var_dir, **env), stdout=log, stderr=log
        )
    server = RouterServer(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"router exited early:\n{server.log()}")
        try:
            return server.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=30)
    return server


@pytest.fixture(scope="session")
def var_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("var")


@pytest.fixture(scope="session")
def router(django_db_setup: None, django_db_blocker: Any, var_dir: Path) -> Iterator[RouterServer]:
    with django_db_blocker.unblock():
        server = start_router(var_dir)
    yield server
    stop_process(server.proc)


@pytest.fixture
def client(router: RouterServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="not-checked", max_retries=0)


# --- simulated workers --------------------------------------------------------------------


class SimulatorLoop:
    """One event loop in a thread runs every simulator of the session, so tests can start
    them cheaply and read their state directly."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="session")
def sim_loop() -> SimulatorLoop:
    return SimulatorLoop()


@pytest.fixture
def simulator(sim_loop: SimulatorLoop) -> Iterator[Callable[..., RunningSimulator]]:
    started: list[RunningSimulator] = []

    def start(model: str = "sim-model", **config: Any) -> RunningSimulator:
        config.setdefault("ttft_ms", 1)
        config.setdefault("itl_ms", 1)
        sim: RunningSimulator = sim_loop.run(start_simulator(SimConfig(model=model, **config)))
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim_loop.run(sim.stop())


@pytest.fixture
def add_worker(router: RouterServer) -> Callable[..., Worker]:
    """Register a simulator through the service layer and wait until the router routes to it."""

    def add(sim: RunningSimulator, name: str = "") -> Worker:
        worker = services.worker_add(url=sim.url, name=name, actor="test")
        router.wait_routable(worker)
        return worker

    return add


@pytest.fixture
def celery_worker(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_celery(tmp_path)
    yield proc
    stop_process(proc)
    print((tmp_path / "celery.log").read_text(errors="replace")[-3000:])


def start_celery(tmp_path: Path) -> subprocess.Popen[bytes]:
    """A Celery worker with beat, on the test database, logging to tmp_path/celery.log."""
    log_path = tmp_path / "celery.log"
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "controlpanel",
        "worker",
        "--beat",
        "--pool",
        "threads",
        "--concurrency",
        "2",
        "--loglevel",
        "INFO",
        "--schedule",
        str(tmp_path / "beat-schedule"),
    ]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=subprocess_env(tmp_path, CONTROLPANEL_PROBE_INTERVAL="0.5"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


StartSimulator = Callable[..., RunningSimulator]
AddWorker = Callable[..., Worker]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With CONTROLPANEL_TESTS_NO_SKIP=1 (CI's PostgreSQL + Redis tier, which has every
    service) a skipped test fails instead: the tests that skip without Redis must run there."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and os.environ.get("CONTROLPANEL_TESTS_NO_SKIP") == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped in a tier that must run every test: {report.longrepr}"
