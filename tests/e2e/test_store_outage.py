"""The router survives its stores going away, through real sockets and a router process of
its own: while its database is unavailable it keeps proxying from its last snapshot and
/health says "degraded" with the error; when the database returns, /health is "ok" again
and a change made meanwhile reaches it, with no restart. With its Redis unreachable it
proxies as usual.

How the database goes away depends on the backend the suite runs on:
- PostgreSQL: the router reaches the server through a TCP relay owned by the test, which
  closes its listener and every connection, then listens again on the same port, as a
  server restart or a network cut looks to a client.
- SQLite has no server to stop, and an open file keeps working when it is moved. The router
  gets its own copy of the test database, and the test renames the table every snapshot
  refresh reads first, so each of its queries fails with a real DatabaseError; renaming it
  back brings the store back.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from django.db import connection

from tests.support import servers
from tests.support.common import ADMIN_HEADERS
from tests.support.relays import TcpRelay
from tests.support.servers import (
    RouterServer,
    StartSimulator,
    free_port,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)
FIRST_TABLE = "controlpanel_routinggeneration"  # RoutingGeneration.current(), every refresh


class Store(Protocol):
    url: str

    def down(self) -> None: ...

    def up(self) -> None: ...


class SqliteCopy:
    """A copy of the test database for one router; down() makes its refreshes fail."""

    def __init__(self, source: str, directory: Path) -> None:
        self.path = directory / "outage.sqlite3"
        with sqlite3.connect(source) as src, sqlite3.connect(self.path) as dst:
            src.backup(dst)
        self.url = f"sqlite:///{self.path}"

    def _rename(self, old: str, new: str) -> None:
        with contextlib.closing(sqlite3.connect(self.path, timeout=20)) as db:
            db.execute(f'ALTER TABLE "{old}" RENAME TO "{new}"')
            db.commit()

    def down(self) -> None:
        self._rename(FIRST_TABLE, FIRST_TABLE + "_away")

    def up(self) -> None:
        self._rename(FIRST_TABLE + "_away", FIRST_TABLE)


class PostgresRelay:
    def __init__(self) -> None:
        db = connection.settings_dict
        self.relay = TcpRelay((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
        self.url = servers.database_url().replace(
            f"@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/", f"@127.0.0.1:{self.relay.port}/"
        )
        assert str(self.relay.port) in self.url

    def down(self) -> None:
        self.relay.down()

    def up(self) -> None:
        self.relay.up()


@pytest.fixture
def store(django_db_blocker: Any, tmp_path: Path) -> Iterator[Store]:
    with django_db_blocker.unblock():
        if connection.vendor == "sqlite":
            yield SqliteCopy(str(connection.settings_dict["NAME"]), tmp_path)
        else:
            relay = PostgresRelay()
            yield relay
            relay.relay.down()


@pytest.fixture
def own_router(store: Store, tmp_path: Path) -> Iterator[RouterServer]:
    server = start_router(tmp_path, DATABASE_URL=store.url)
    yield server
    stop_process(server.proc)


def chat(router: RouterServer, model: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return router.post("/v1/chat/completions", json={**body, "stream": stream})


def add_worker_through(router: RouterServer, url: str) -> int:
    """An operator adds a worker through this router's own admin API, so it lands in the
    database this router reads, whichever that is."""
    response = router.post("/api/workers", json={"url": url}, headers=ADMIN_HEADERS)
    assert response.status_code == 201, response.text
    worker_id: int = response.json()["id"]
    router.wait_for(lambda seen: seen[worker_id]["routable"])
    return worker_id


def health(router: RouterServer) -> dict[str, Any]:
    response = router.get("/health")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_the_router_serves_from_its_snapshot_while_the_database_is_down(
    own_router: RouterServer, store: Store, simulator: StartSimulator
) -> None:
    router = own_router
    add_worker_through(router, simulator("before").url)
    assert chat(router, "before").status_code == 200
    assert health(router)["status"] == "ok"

    store.down()
    degraded = wait_until(lambda: (h := health(router))["status"] == "degraded" and h)
    assert degraded["snapshot_error"], degraded
    assert degraded["routable_workers"] == 1
    # An admin change cannot be written: a 503 in the API's JSON shape, not an HTML page.
    refused = httpx.post(
        f"{router.url}/api/workers",
        json={"url": simulator("during").url},
        headers=ADMIN_HEADERS,
        timeout=30,
    )
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["type"] == "DatabaseError"
    assert refused.headers["retry-after"]
    for _ in range(10):
        response = chat(router, "before")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
    streamed = chat(router, "before", stream=True)
    assert streamed.status_code == 200
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert router.get("/v1/models").json()["data"][0]["id"] == "before"
    assert health(router)["status"] == "degraded"

    store.up()
    recovered = wait_until(lambda: (h := health(router))["status"] == "ok" and h)
    assert recovered["snapshot_error"] is None
    # A change made after the outage reaches the same router process.
    add_worker_through(router, simulator("after").url)
    wait_until(lambda: chat(router, "after").status_code == 200)
    assert chat(router, "before").status_code == 200
    assert router.proc.poll() is None, "the router restarted or died"


def test_the_router_proxies_with_its_redis_unreachable(
    tmp_path: Path, simulator: StartSimulator
) -> None:
    """Redis carries the dashboards' live feed and Celery, never the proxy's path: a router
    whose Redis refuses every connection starts, proxies, takes admin changes and still
    shuts down cleanly (the live feed's Redis listener once failed the whole shutdown)."""
    closed = f"redis://127.0.0.1:{free_port()}/0"
    router = start_router(tmp_path, REDIS_URL=closed)
    try:
        add_worker_through(router, simulator("no-redis").url)
        for _ in range(5):
            assert chat(router, "no-redis").status_code == 200
        streamed = chat(router, "no-redis", stream=True)
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert health(router)["routable_workers"] == 1
        assert router.proc.poll() is None
    finally:
        stop_process(router.proc)
    log = router.log()
    assert "live nudges unavailable" in log, log[-3000:]  # it did try Redis
    assert "shutdown failed" not in log, log[-3000:]
    assert "Application shutdown complete" in log, log[-3000:]
