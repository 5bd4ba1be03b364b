"""launcher.supervisor with tiny real children (`python -c`): the routers' clients started
once a router answers and stopped first, a --url-child started once its URL answers, a child
that dies stopping everything (the watch woken by its exit), a server child's log shown, a
port in use refused.

The supervisor runs in a child process of its own (it takes SIGTERM and SIGINT); its router
processes are stand-ins answering 200 on the inherited socket, as uvicorn would, since a unit
test starts no real router (the real one is tests/e2e's)."""

from __future__ import annotations

import http.server
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from launcher.listener import listener_bind
from launcher.supervisor import SignalWake
from tests.support.common import ROOT
from tests.support.servers import free_port

CEILING_S = 60.0
# A child that says when it is up and when it gets SIGTERM, in the shared log.
CHILD = """
import os, signal, sys, time
name, log = sys.argv[1], sys.argv[2]
def term(*_):
    with open(log, "a") as f:
        f.write(f"{name} term\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
with open(log, "a") as f:
    f.write(f"{name} up {os.getpid()}\\n")
while True:
    time.sleep(1)
"""
# A router stand-in: up and term in the log as CHILD, 200 on every GET, on the socket the
# supervisor passed down.
ROUTER = (
    CHILD.split("while True")[0]
    + """
import http.server, socket
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("", 0), Ok, bind_and_activate=False)
server.socket = socket.socket(fileno=int(sys.argv[3]))
server.serve_forever()
"""
)
SUPERVISOR = """
import sys
from launcher.plan import plan_from_args
from launcher.supervisor import Supervisor
ROUTER, CHILD, LOG = sys.argv[1:4]
class StandIns(Supervisor):
    def _start_routers(self, listener):
        fd = listener.fileno()
        command = [sys.executable, "-c", ROUTER, "router", LOG, str(fd)]
        self._spawn("router", command, pass_fds=(fd,))
raise SystemExit(StandIns(plan_from_args(sys.argv[4:])).run())
"""


def child(name: str, log: Path) -> str:
    return shlex.join([sys.executable, "-c", CHILD, name, str(log)])


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CEILING_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {CEILING_S:.0f} s"
        time.sleep(0.05)


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def pids(log: Path) -> list[int]:
    return [int(line.split()[2]) for line in lines(log) if " up " in line]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextmanager
def supervisor(log: Path, *argv: str) -> Iterator[subprocess.Popen[str]]:
    command = [sys.executable, "-c", SUPERVISOR, ROUTER, CHILD, str(log),
               "--port", str(free_port()), "--grace", "1", *argv]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_signal_stops_the_routers_clients_first_then_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with supervisor(
        log, "--ready-path", "/ready", "--ready-child", "agent", child("agent", log),
        "--child", "celery", child("celery", log),
    ) as proc:  # fmt: skip
        wait_for(lambda: len(pids(log)) == 3, "three children up")
        started = [line.split()[0] for line in lines(log)]
        assert started.index("router") < started.index("agent")  # once the router answered
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(CEILING_S) == 0
    stopped = [line.split()[0] for line in lines(log) if line.endswith(" term")]
    assert stopped[0] == "agent" and set(stopped) == {"agent", "router", "celery"}
    assert all(gone(pid) for pid in pids(log))


class Health(http.server.BaseHTTPRequestHandler):
    """503 until `ready`; counts the requests."""

    ready = False
    asked = 0

    def do_GET(self) -> None:
        type(self).asked += 1
        self.send_response(200 if self.ready else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_url_child_starts_once_its_url_answers(tmp_path: Path) -> None:
    log = tmp_path / "log"
    health = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{health.server_port}/health"
    try:
        with supervisor(log, "--url-child", "agent", url, child("agent", log)) as proc:
            wait_for(lambda: Health.asked >= 2, "the URL asked twice")
            assert "agent" not in {line.split()[0] for line in lines(log)}  # 503: not yet
            Health.ready = True
            wait_for(lambda: len(pids(log)) == 2, "the agent up")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(CEILING_S) == 0
            assert f"{url} answered after" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        health.shutdown()
        health.server_close()


def test_a_child_that_dies_stops_everything_and_is_named(tmp_path: Path) -> None:
    log = tmp_path / "log"
    dies = shlex.join([sys.executable, "-c", "import sys; sys.exit(3)"])
    with supervisor(log, "--child", "celery", child("celery", log), "--child", "bad", dies) as proc:
        assert proc.wait(CEILING_S) == 1
        assert "bad exited with code 3; stopping" in proc.stderr.read()  # type: ignore[union-attr]
    assert all(gone(pid) for pid in pids(log))


def test_a_dead_server_childs_log_tail_is_shown(tmp_path: Path) -> None:
    log, server_log = tmp_path / "log", tmp_path / "vllm.log"
    server = shlex.join([sys.executable, "-c", "print('CUDA out of memory'); raise SystemExit(2)"])
    with supervisor(log, "--server-child", "vllm", str(server_log), server) as proc:
        assert proc.wait(CEILING_S) == 1
        said = proc.stderr.read()  # type: ignore[union-attr]
    assert "vllm exited with code 2" in said
    assert f"--- the end of {server_log} ---\nCUDA out of memory" in said


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with listener_bind("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "launcher", "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=CEILING_S,
        )  # fmt: skip
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_the_watch_wakes_when_a_child_exits_not_at_its_timeout() -> None:
    """The idle supervisor sleeps between checks (WATCH_SECONDS); a child's exit ends the
    sleep at once, through SIGCHLD."""
    with SignalWake() as wake:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        started = time.monotonic()
        wake.wait(CEILING_S)
        waited = time.monotonic() - started
    assert child.wait(CEILING_S) == 0
    assert waited < CEILING_S  # woken by the exit, not by the timeout
