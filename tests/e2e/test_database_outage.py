"""PostgreSQL really stopped (an instance this test starts on its own port, never the
machine's shared one, harness.databases.PostgresServer): every admin endpoint and dashboard
page answers 503 with Retry-After, never hanging (JSON for the API, a styled page for the
dashboard), the router keeps serving /v1, and everything recovers by itself when the database
is back."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.databases import PostgresServer
from tests.support.common import ADMIN_HEADERS, ROOT
from tests.support.servers import start_router, stop_process, subprocess_env, wait_until

# `make test` installs Debian's PostgreSQL server when it is missing; without it these tests
# fail (in the fixture), rather than skip.
API_PATHS = ["/api/workers", "/api/workers/1", "/api/models", "/api/keys", "/api/usage",
             "/api/aliases", "/api/rollouts"]  # fmt: skip
PAGES = ["/", "/workers/1/", "/models/", "/events/", "/rollouts/", "/keys/", "/usage/"]


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    # Outside pytest's own tmp (root-only): the server runs as nobody, who must reach it.
    root = Path(tempfile.mkdtemp(prefix="controlpanel-pg-"))
    root.chmod(0o755)
    server = PostgresServer(root)
    server.start()
    yield server
    with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
        server.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_database_outage_is_a_503_everywhere_and_recovers(
    postgres: PostgresServer, tmp_path: Path
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
        # Each answer comes within the session's 10 s client timeout (never a hang); how
        # fast ("about a second") is a speed figure, not this test's to time.
        for path in API_PATHS:
            answer = session.get(path, headers=ADMIN_HEADERS)
            assert answer.status_code == 503, (path, answer.status_code, answer.text[:300])
            assert answer.headers["retry-after"], path
            assert answer.json()["error"]["type"] == "DatabaseError"
        for path in PAGES:
            answer = session.get(path)
            assert answer.status_code == 503, (path, answer.status_code, answer.text[:300])
            assert answer.headers["retry-after"], path
            assert "database is unavailable" in answer.text and 'href="/events/"' in answer.text
        assert router.get("/health").status_code == 200  # the router itself keeps serving
        postgres.start()
        # It recovers by itself: no restart, only time. psycopg's pool backs off between
        # reconnects (1, 2, 4 ... s) and grows one connection at a time, so for a few seconds
        # after the first success a request can still wait out the pool's timeout (a 503 with
        # Retry-After, as during the outage); every path must come back without a restart.
        # (A path that names a worker the fleet does not have answers 404 once it is back.)
        for path in API_PATHS:
            wait_until(lambda p=path: session.get(p, headers=ADMIN_HEADERS).status_code < 500)
        for path in PAGES:
            wait_until(lambda p=path: session.get(p).status_code < 500)
        assert session.get("/").status_code == 200
    finally:
        stop_process(router.proc)


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
