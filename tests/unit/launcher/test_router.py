"""launcher.router: one router child serving an ASGI application on the socket it inherits,
with its place in the log line, a clean exit on SIGTERM, and uvicorn's startup failure code.
Run in a child process as the supervisor runs it, with a tiny ASGI application in place of
the control panel's (a unit test starts no real router: tests/e2e does)."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
from pathlib import Path

from launcher.listener import listener_bind
from launcher.router import STARTUP_FAILURE
from tests.support.common import ROOT

CEILING_S = 60.0
# launcher.router.main, with APP a tiny application (`fail`: its startup fails).
RUN = """
import sys
import launcher.router as router
fail = sys.argv.pop() == "fail"
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                kind = "failed" if fail else "complete"
                await send({"type": f"lifespan.startup.{kind}"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"routed"})
router.APP = app
raise SystemExit(router.main())
"""


def start(fd: int, stderr: Path, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CONTROLPANEL_ROUTER_INDEX": "1", "CONTROLPANEL_ROUTERS": "2"}
    with stderr.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", RUN, "--fd", str(fd), "--grace", "1", mode],
            cwd=ROOT, env=env, pass_fds=(fd,), stderr=out,
        )  # fmt: skip


def get(port: int) -> tuple[int, bytes] | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CEILING_S)
    try:
        conn.request("GET", "/")
        response = conn.getresponse()
        # The Date header is renewed by the server's once-a-second tick (launcher.router.Server).
        assert response.getheader("date", "").endswith(" GMT")
        return response.status, response.read()
    except OSError:
        return None
    finally:
        conn.close()


def test_a_router_serves_on_the_inherited_socket_and_shuts_down_on_sigterm(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    with listener_bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        proc = start(sock.fileno(), stderr, "ok")
        try:
            # Connections wait in the shared socket's backlog until the router accepts them.
            assert get(port) == (200, b"routed")
            said = stderr.read_text()
            line = f"INFO uvicorn: Router 2 of 2 (pid {proc.pid}) serving http://127.0.0.1:{port}"
            assert line in said
            proc.send_signal(signal.SIGTERM)
            # uvicorn shuts down, then raises the signal again: the child dies of SIGTERM.
            assert proc.wait(CEILING_S) == -signal.SIGTERM
            assert "Application shutdown complete." in stderr.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_sigint_ends_it_with_code_0(tmp_path: Path) -> None:
    with listener_bind("127.0.0.1", 0) as sock:
        proc = start(sock.fileno(), tmp_path / "stderr", "ok")
        try:
            assert get(sock.getsockname()[1]) == (200, b"routed")  # it is serving
            proc.send_signal(signal.SIGINT)
            assert proc.wait(CEILING_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_an_application_that_fails_to_start_exits_with_uvicorns_code(tmp_path: Path) -> None:
    with listener_bind("127.0.0.1", 0) as sock:
        proc = start(sock.fileno(), tmp_path / "stderr", "fail")
        try:
            assert proc.wait(CEILING_S) == STARTUP_FAILURE == 3
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
