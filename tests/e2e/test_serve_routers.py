"""`manage.py serve --routers N`: N router processes on one port, behind a supervisor (the
launcher) that loads no Django, as real processes through real sockets.

Several routers share state through Redis, so the test that runs two of them runs when
REDIS_URL names one (the second CI tier, where a skip fails); the refusal without Redis and
the single router that `auto` means without it run in both tiers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from controlpanel.registry.models import RouterInstance
from tests.support.common import ADMIN_HEADERS, REDIS_URL, ROOT, needs_redis
from tests.support.servers import StartSimulator, free_port_run, subprocess_env, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
GRACE = 5  # CONTROLPANEL_SHUTDOWN_GRACE for these runs: open streams' time after SIGTERM
# Python modules a supervisor that loads no Django never has, whatever imports them.
HEAVY = ("django", "celery", "channels", "uvicorn", "controlpanel", "routing", "simulator")


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []


def start_serve(tmp_path: Path, *args: str, redis_url: str) -> Served:
    """`manage.py serve --no-celery` on the test database, ready when /health answers."""
    port = free_port_run(1)
    env = subprocess_env(tmp_path, CONTROLPANEL_SHUTDOWN_GRACE=str(GRACE))
    env.pop("REDIS_URL_FILE", None)
    env.pop("REDIS_URL", None)
    if redis_url:
        env["REDIS_URL"] = redis_url
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "manage.py", "serve", "--port", str(port), "--no-celery", *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    served = Served(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early:\n{served.log()}")
        try:
            return httpx.get(f"{served.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=60, interval=0.2)
    return served


@pytest.fixture
def stopper() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for served in started:
        if served.proc.poll() is None:  # a test that failed before it stopped serve
            routers = served.children()
            served.proc.terminate()
            try:
                served.proc.wait(GRACE + 10)
            except subprocess.TimeoutExpired:
                served.proc.kill()
                served.proc.wait()
            # Killed, the supervisor leaves its routers running, holding the test database.
            for pid in routers:
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    if b"launcher.router" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)


def assert_supervisor_loads_no_django(pid: int) -> int:
    """The process serve became is `python -m launcher`, and neither it nor what it imports
    pulls in Django or the project; returns its resident memory in KiB."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[1:3] == [b"-m", b"launcher"], argv
    # No third-party extension module (psycopg, orjson, uvloop, ...) is mapped in it.
    assert "site-packages" not in Path(f"/proc/{pid}/maps").read_text()
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, launcher.supervisor; print(*sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not [name for name in loaded if name.split(".")[0] in HEAVY and name != "launcher"]
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def listening_socket(pid: int, fd: int) -> str:
    return os.readlink(f"/proc/{pid}/fd/{fd}")


def open_files(pid: int) -> set[str]:
    """What each of a process's descriptors points at (a socket's or pipe's inode)."""
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # one closed while listed
            held.add(os.readlink(fd))
    return held


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text(), f"{pid} is still running"


@needs_redis
def test_two_routers_serve_v1_and_the_dashboard_on_one_port_and_stop_cleanly(
    tmp_path: Path, simulator: StartSimulator, stopper: list[Served]
) -> None:
    served = start_serve(tmp_path, "--routers", "2", redis_url=REDIS_URL)
    stopper.append(served)
    routers = served.children()
    assert len(routers) == 2, served.log()
    assert "Routers: 2 processes share port" in served.log()
    # Both inherited the one listening socket (fd 3); the supervisor kept no copy of it.
    assert listening_socket(routers[0], 3) == listening_socket(routers[1], 3)
    assert listening_socket(routers[0], 3).startswith("socket:")
    assert listening_socket(routers[0], 3) not in open_files(served.proc.pid)
    rss_kib = assert_supervisor_loads_no_django(served.proc.pid)
    print(f"launcher RSS with 2 routers: {rss_kib / 1024:.1f} MiB")

    sim = simulator("m", ttft_ms=100, itl_ms=5)
    added = httpx.post(
        f"{served.url}/api/workers", json={"url": sim.url}, headers=ADMIN_HEADERS, timeout=10
    )
    assert added.status_code == 201, added.text

    wait_until(lambda: every_router_routes("m", served.url), interval=0.2)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    assert "m" in {m.id for m in client.models.list()}
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content
    login = httpx.get(f"{served.url}/admin/login/", timeout=10)
    assert login.status_code == 200 and "csrfmiddlewaretoken" in login.text
    dashboard = httpx.get(f"{served.url}/", timeout=10)
    assert dashboard.status_code == 302 and "/login/" in dashboard.headers["location"]

    def served_by_both_routers() -> bool:
        # Concurrent requests on new connections; each router reports its own traffic and
        # process id to the control plane about once a second.
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        with ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda _: (
                        httpx.post(
                            f"{served.url}/v1/completions", json=body, timeout=10
                        ).status_code
                    ),
                    range(8),
                )
            )
        assert codes == [200] * 8
        traffic = dict(RouterInstance.objects.values_list("pid", "traffic"))
        return all(traffic.get(pid, {}).get("m", {}).get("requests", 0) > 0 for pid in routers)

    wait_until(served_by_both_routers, interval=1.0)

    # An open stream on either router gets its grace after SIGTERM; then everything stops.
    slow = simulator("slow", itl_ms=100)
    httpx.post(
        f"{served.url}/api/workers", json={"url": slow.url}, headers=ADMIN_HEADERS, timeout=10
    ).raise_for_status()
    wait_until(lambda: every_router_routes("slow", served.url), interval=0.2)
    lines: list[str] = []

    def stream() -> None:
        body = {"model": "slow", "prompt": "x", "max_tokens": 20, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: slow.state.running == 1)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=GRACE) == 0, served.log()
    streamer.join(timeout=5)
    assert lines[-1] == "data: [DONE]" and len(lines) == 21, lines  # nothing cut short
    assert_gone(routers)


def every_router_routes(model: str, url: str) -> bool:
    """Each call is a new connection, so both routers answer some of the eight."""
    return all(
        model in httpx.get(f"{url}/list_models", timeout=5).json()["models"] for _ in range(8)
    )


def test_several_routers_without_redis_are_refused_naming_redis_url(tmp_path: Path) -> None:
    env = subprocess_env(tmp_path)
    env.pop("REDIS_URL", None)
    env.pop("REDIS_URL_FILE", None)
    command = [
        sys.executable,
        "manage.py",
        "serve",
        "--routers",
        "2",
        "--port",
        str(free_port_run(1)),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "REDIS_URL" in done.stderr, done.stderr + done.stdout


def test_auto_without_redis_is_one_router_under_a_supervisor_without_django(
    tmp_path: Path, stopper: list[Served]
) -> None:
    served = start_serve(tmp_path, "--routers", "auto", redis_url="")
    stopper.append(served)
    assert "--routers auto: 1 router, since REDIS_URL is unset." in served.log()
    routers = served.children()
    assert len(routers) == 1
    rss_kib = assert_supervisor_loads_no_django(served.proc.pid)
    print(f"launcher RSS with 1 router: {rss_kib / 1024:.1f} MiB")
    assert httpx.get(f"{served.url}/admin/login/", timeout=10).status_code == 200
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=GRACE) == 0, served.log()
    assert_gone(routers)


@needs_redis
def test_by_default_with_redis_serve_runs_one_router_per_core(
    tmp_path: Path, stopper: list[Served]
) -> None:
    """No --routers: auto, which with Redis is the machine's cores (#29: one command uses
    the machine)."""
    served = start_serve(tmp_path, redis_url=REDIS_URL)
    stopper.append(served)
    cores = len(os.sched_getaffinity(0))
    assert len(served.children()) == cores, served.log()
    if cores > 1:
        assert f"Routers: {cores} processes share port" in served.log()
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=GRACE) == 0, served.log()
