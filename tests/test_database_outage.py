"""PostgreSQL really stopped (an instance this test starts on its own port, never the
machine's shared one): every admin endpoint and dashboard page answers 503 with
Retry-After within about a second (JSON for the API, a styled page for the dashboard), the
router keeps serving /v1, and everything recovers by itself when the database is back."""

from __future__ import annotations

import contextlib
import glob
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    ADMIN_HEADERS,
    ROOT,
    free_port,
    start_router,
    stop_process,
    subprocess_env,
)

PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
# `make test` installs Debian's PostgreSQL server when it is missing; without it these tests
# fail (in the fixture), rather than skip.
API_PATHS = ["/api/workers", "/api/workers/1", "/api/models", "/api/keys", "/api/usage",
             "/api/aliases", "/api/rollouts"]  # fmt: skip
PAGES = ["/", "/workers/1/", "/models/", "/events/", "/rollouts/", "/keys/", "/usage/"]


class Postgres:
    def __init__(self, root: Path) -> None:
        assert PG_BIN, "Debian's PostgreSQL server is missing: `make test` installs it"
        self.bin, self.data, self.port = Path(PG_BIN[-1]), root / "pgdata", free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust")

    def _run(self, tool: str, *args: str) -> None:
        # PostgreSQL refuses to run as root: as the nobody user, owning its directory.
        command = [str(self.bin / tool), *args]
        shutil.chown(self.data.parent, "nobody")
        subprocess.run(["runuser", "-u", "nobody", "--", *command], check=True,
                       capture_output=True, cwd="/tmp")  # fmt: skip

    def start(self) -> None:
        opts = f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-w", "start", "-l",
                  str(self.data.parent / "pg.log"))  # fmt: skip

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    # Outside pytest's own tmp (root-only): the server runs as nobody, who must reach it.
    root = Path(tempfile.mkdtemp(prefix="controlpanel-pg-"))
    root.chmod(0o755)
    server = Postgres(root)
    server.start()
    yield server
    with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
        server.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_database_outage_is_a_fast_503_everywhere_and_recovers(
    postgres: Postgres, tmp_path: Path
) -> None:
    env = subprocess_env(tmp_path, DATABASE_URL=postgres.url)
    setup = (
        "from django.contrib.auth import get_user_model as u; "
        "u().objects.create_user('op', password='op-password-1', is_staff=True)"
    )
    for command in (["migrate", "-v0"], ["shell", "-c", setup]):
        subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env, check=True,
                       capture_output=True)  # fmt: skip
    router = start_router(tmp_path, DATABASE_URL=postgres.url)
    try:
        session = _logged_in(router.url)
        assert session.get("/api/workers", headers=ADMIN_HEADERS).status_code == 200
        postgres.stop()
        for path in API_PATHS:
            answer, took = _timed(session, path, headers=ADMIN_HEADERS)
            assert answer.status_code == 503, (path, answer.status_code, answer.text[:300])
            assert answer.headers["retry-after"] and took < 1.6, (path, took)
            assert answer.json()["error"]["type"] == "DatabaseError"
        for path in PAGES:
            answer, took = _timed(session, path)
            assert answer.status_code == 503, (path, answer.status_code, answer.text[:300])
            assert answer.headers["retry-after"] and took < 1.6, (path, took)
            assert "database is unavailable" in answer.text and 'href="/events/"' in answer.text
        assert router.get("/health").status_code == 200  # the router itself keeps serving
        postgres.start()
        deadline = time.monotonic() + 15
        while session.get("/api/workers", headers=ADMIN_HEADERS).status_code != 200:
            assert time.monotonic() < deadline, "the API did not recover by itself"
            time.sleep(0.3)
        assert session.get("/").status_code == 200
    finally:
        stop_process(router.proc)


def _timed(session: httpx.Client, path: str, **kwargs: object) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = session.get(path, **kwargs)  # type: ignore[arg-type]
    return answer, time.monotonic() - started


def _logged_in(url: str) -> httpx.Client:
    session = httpx.Client(base_url=url, timeout=10)
    session.get("/admin/login/")
    token = session.cookies["csrftoken"]
    answer = session.post(
        "/admin/login/?next=/",
        data={"username": "op", "password": "op-password-1", "csrfmiddlewaretoken": token},
        headers={"Referer": f"{url}/admin/login/"},
    )
    assert answer.status_code == 302, answer.text[:300]
    return session
