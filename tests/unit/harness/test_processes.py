"""Child processes: spawned with a log, stopped by SIGTERM or, past the deadline, SIGKILL
(said first), a process group stopped whole; the log's tail; readiness checks and free
ports. Waits are ceilings on a handshake, never fixed sleeps."""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import processes
from harness.processes import Running, spawn, stop, wait_until

CEILING_S = 60.0
IGNORE_TERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)
GROUP = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print('ready', flush=True); time.sleep(600)"
)


def started(tmp_path: Path, code: str, **options: bool) -> Running:
    log = tmp_path / "child.log"
    child = spawn("child", [sys.executable, "-c", code], log=log, **options)
    wait_until(lambda: "ready" in processes.log_tail(log), timeout=CEILING_S)
    return child


def test_a_child_that_ignores_sigterm_is_killed_past_the_deadline(tmp_path: Path) -> None:
    child = started(tmp_path, IGNORE_TERM)
    killed: list[str] = []
    stop([child], 0.2, on_kill=lambda c: killed.append(c.name))
    assert killed == ["child"] and not child.alive()
    assert child.proc.returncode == -9
    assert child.log_tail() == "ready"


def test_a_child_that_honours_sigterm_is_not_killed(tmp_path: Path) -> None:
    child = started(tmp_path, "import time; print('ready', flush=True); time.sleep(600)")
    killed: list[Running] = []
    stop([child], CEILING_S, on_kill=killed.append)
    assert killed == [] and child.proc.returncode == -15
    stop([child], CEILING_S)  # stopping what has stopped is harmless


def test_a_group_is_stopped_whole(tmp_path: Path) -> None:
    child = started(tmp_path, GROUP, group=True)
    assert processes.group_running(child.pid)
    stop([child], CEILING_S)
    assert not processes.group_running(child.pid)


def test_the_log_tail_is_its_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "long.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert processes.log_tail(log, 2) == "line 99998\nline 99999"
    assert processes.log_tail(tmp_path / "missing.log") == "(no log)"
    assert Running("x", None).log_tail() == "(no log)"  # type: ignore[arg-type]


@pytest.fixture
def http_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_readiness_is_one_get_answered_200(http_server: int) -> None:
    assert processes.http_answers("127.0.0.1", http_server, "/ok", timeout=CEILING_S)
    assert not processes.http_answers("127.0.0.1", http_server, "/busy", timeout=CEILING_S)
    closed = processes.free_port()
    assert not processes.http_answers("127.0.0.1", closed, "/ok")


def test_wait_until_returns_the_value_or_says_the_last_one() -> None:
    answers = iter([0, "", "done"])
    assert wait_until(lambda: next(answers), timeout=CEILING_S, interval=0) == "done"
    with pytest.raises(TimeoutError, match="last value: 0"):
        wait_until(lambda: 0, timeout=0)


def test_free_ports_are_distinct() -> None:
    ports = processes.free_ports(50)
    assert len(set(ports)) == 50 and all(0 < p < 65536 for p in ports)
