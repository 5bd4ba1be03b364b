"""The processes and sockets of the tests that run the real thing: the real router (uvicorn)
in a subprocess on the test database, the simulators' event loop, a Celery worker, and
waiting on a condition rather than sleeping. Free ports come from a band of each xdist
worker's own (free_port_run); waiting and stopping a child are harness.processes' (here with
the suite's ceiling and failure); the fixtures built on these are in tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from django.db import connection

from controlpanel.registry.models import RoutingGeneration, Worker
from harness import processes
from simulator.server import RunningSimulator
from tests.support.common import ROOT

_RESERVED_LOW, _RESERVED_BAND = 20_000, 3_000  # 20000-31999: below the ephemeral range
_handed_out: set[int] = set()  # this process's ports so far: two picks in a row differ


def free_port_run(n: int) -> int:
    """The first of `n` consecutive free ports, for a server that binds them later (a
    subprocess's `--port` seconds later, a simulator's KV socket). Taken below the kernel's
    ephemeral range (ip_local_port_range), where no `bind(0)` and no outgoing connection of
    another test can take them meanwhile: one did ("address already in use" for a demo
    engine), and a router whose port a simulator took answered /health through that
    simulator, then refused every request. Each xdist worker draws from a band of its own,
    and never hands out a port twice until half its band is spent."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    band = int(worker) if worker.isdigit() else 0
    low = _RESERVED_LOW + (band % 4) * _RESERVED_BAND
    if len(_handed_out) > _RESERVED_BAND // 2:
        _handed_out.clear()
    for _ in range(500):
        base = random.randrange(low, low + _RESERVED_BAND - n)
        run = range(base, base + n)
        if _handed_out.intersection(run):
            continue
        if _all_bind(run):
            _handed_out.update(run)
            return base
    raise RuntimeError(f"no run of {n} free ports found")


def _all_bind(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """A free port from this worker's band (free_port_run): also for a port that must
    stay closed, since no other test's server or connection lands there."""
    return free_port_run(1)


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (consecutive) from this worker's band."""
    base = free_port_run(n)
    return list(range(base, base + n))


def database_url() -> str:
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
        "DATABASE_URL": database_url(),
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
    """harness.processes.wait_until with the suite's ceiling, failing as a test does (an
    AssertionError, not a TimeoutError)."""
    try:
        return processes.wait_until(predicate, timeout=timeout, interval=interval)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def stop_process(proc: subprocess.Popen[bytes], *, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL past `timeout` (harness.processes.stop on a plain child)."""
    processes.stop([processes.Running("child", proc)], timeout)


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
        take longer than one poll). Equality with the counter read at each try, not `>=`:
        the suite's flush between tests deletes the counter's row, and the next change
        starts it again at a random point that may lie below what the router last saw."""

        def caught_up() -> bool:
            seen = int(self.get("/health").json()["snapshot_generation"])
            return seen == RoutingGeneration.current()

        wait_until(caught_up)

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
            answer = server.get("/health")
        except httpx.HTTPError:
            return False
        # A router's own answer, not another server's on a port taken meanwhile.
        return answer.status_code == 200 and b"snapshot_generation" in answer.content

    wait_until(healthy)
    return server


# --- simulated workers and Celery -----------------------------------------------------------


class SimulatorLoop:
    """One event loop in a thread runs every simulator of the session, so tests can start
    them cheaply and read their state directly."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


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
