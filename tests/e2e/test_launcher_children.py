"""The launcher's two kinds of child that `serve --demo-real N` adds, with plain processes:
a server in a process group of its own (stopped with its whole group) and a child that
waits for a URL to answer before it starts."""

from __future__ import annotations

import http.server
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.common import ROOT
from tests.support.servers import wait_until

SUPERVISE = """
import sys
from launcher.plan import plan_from_args
from launcher.supervisor import Supervisor
plan = plan_from_args(sys.argv[1:], {})
# No router: what is under test is the server and URL children alone.
plan = type(plan)(0, plan.host, plan.port, 1, plan.children)
raise SystemExit(Supervisor(plan).run())
"""


@pytest.fixture
def health_url(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP server answering 200 on /health."""
    (tmp_path / "health").write_text("ok")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except FileNotFoundError:
        return False


def test_a_server_child_stops_with_its_whole_group_and_a_url_child_waits(
    tmp_path: Path, health_url: str
) -> None:
    # The server leaves a process behind that ignores SIGTERM, as an engine process could:
    # the group's last SIGKILL ends it.
    orphan, started = tmp_path / "orphan.pid", tmp_path / "started"
    server = f"(trap '' TERM; exec sleep 600) & echo $! > {orphan}; echo up; exec sleep 600"
    log = tmp_path / "server.log"
    agent = shlex.join(["sh", "-c", f"touch {started}; exec sleep 600"])
    never = shlex.join(["touch", str(tmp_path / "no")])
    command = [
        sys.executable, "-c", SUPERVISE, "--port", "0",
        "--server-child", "server", str(log), shlex.join(["sh", "-c", server]),
        "--url-child", "agent", health_url, agent,
        "--url-child", "never", "http://127.0.0.1:9/health", never,
    ]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: orphan.exists() and orphan.read_text().strip())
        wait_until(started.exists)  # its URL answered
        assert log.read_text().strip() == "up"  # the server's output went to its log
        pid = int(orphan.read_text())
        assert os.getpgid(pid) != os.getpgid(proc.pid)  # a group of its own
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"{health_url} answered after".encode() in err
    assert not (tmp_path / "no").exists()  # its URL never answered
    assert not alive(pid)  # the supervisor waited for the whole group
