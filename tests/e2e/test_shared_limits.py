"""Client keys' rate limits shared through Redis, and Redis's reachability on /health, with
real router processes.

The tests that need a working Redis run when REDIS_URL names one: the second CI tier, which
fails rather than skips when Redis is unreachable. The unreachable-Redis test runs in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.common import REDIS_URL, needs_redis
from tests.support.keyed import add_keyed_worker, bearer, error_of, issue
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
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def keyed_routers(tmp_path: Path, count: int, redis_url: str) -> list[RouterServer]:
    return [
        start_router(tmp_path, CONTROLPANEL_REQUIRE_API_KEY="1", REDIS_URL=redis_url)
        for _ in range(count)
    ]


@pytest.fixture
def stopper() -> Iterator[list[RouterServer]]:
    started: list[RouterServer] = []
    yield started
    for router in started:
        stop_process(router.proc)


def health(router: RouterServer) -> dict[str, Any]:
    body: dict[str, Any] = router.get("/health").json()
    return body


@needs_redis
def test_two_routers_together_hold_a_key_to_its_requests_per_minute(
    tmp_path: Path, simulator: StartSimulator, stopper: list[RouterServer]
) -> None:
    routers = keyed_routers(tmp_path, 2, REDIS_URL)
    stopper.extend(routers)
    first, second = routers
    everything = issue(first, "all")
    sim = simulator("m")
    add_keyed_worker(first, sim, everything)
    limited = issue(first, "shared", rpm=4)

    def second_ready() -> bool:  # both routers read the same database
        models = second.get("/v1/models", headers=bearer(limited))
        return models.status_code == 200 and bool(models.json()["data"])

    wait_until(second_ready)
    statuses = [
        router.post("/v1/chat/completions", json=CHAT, headers=bearer(limited)).status_code
        for router in (first, second) * 4
    ]
    # Per process, each router alone would have let 4 through: 8 in all.
    assert statuses.count(200) == 4 and statuses.count(429) == 4, statuses
    refused = first.post("/v1/chat/completions", json=CHAT, headers=bearer(limited))
    assert "requests per minute (4)" in error_of(refused)["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert health(first)["redis"] == "ok" and health(first)["status"] == "ok"


@needs_redis
def test_a_redis_outage_degrades_health_limits_per_process_and_recovers(
    tmp_path: Path, simulator: StartSimulator, stopper: list[RouterServer]
) -> None:
    target = urlsplit(REDIS_URL)
    relay = TcpRelay((target.hostname or "127.0.0.1", target.port or 6379))
    via_relay = REDIS_URL.replace(target.netloc, f"127.0.0.1:{relay.port}")
    try:
        (router,) = keyed_routers(tmp_path, 1, via_relay)
        stopper.append(router)
        everything = issue(router, "all")
        add_keyed_worker(router, simulator("m"), everything)
        limited = issue(router, "limited", rpm=600)
        assert health(router)["redis"] == "ok"

        relay.down()
        degraded = wait_until(lambda: (h := health(router))["redis"] != "ok" and h)
        assert degraded["status"] == "degraded", degraded
        for _ in range(5):  # served, limited by this process's own buckets meanwhile
            response = router.post("/v1/chat/completions", json=CHAT, headers=bearer(limited))
            assert response.status_code == 200, response.text

        relay.up()
        recovered = wait_until(lambda: (h := health(router))["redis"] == "ok" and h)
        assert recovered["status"] == "ok"
        response = router.post("/v1/chat/completions", json=CHAT, headers=bearer(limited))
        assert response.status_code == 200
        assert router.proc.poll() is None, "the router restarted or died"
    finally:
        relay.down()


def test_an_unreachable_redis_shows_on_health_and_keys_still_work(
    tmp_path: Path, simulator: StartSimulator, stopper: list[RouterServer]
) -> None:
    (router,) = keyed_routers(tmp_path, 1, f"redis://127.0.0.1:{free_port()}/0")
    stopper.append(router)
    everything = issue(router, "all")
    add_keyed_worker(router, simulator("m"), everything)
    degraded = wait_until(lambda: (h := health(router))["redis"] != "ok" and h)
    assert degraded["status"] == "degraded" and "Error" in degraded["redis"], degraded
    slow = issue(router, "slow", rpm=2)
    statuses = [
        router.post("/v1/chat/completions", json=CHAT, headers=bearer(slow)).status_code
        for _ in range(3)
    ]
    assert statuses == [200, 200, 429]  # the limit holds, in this process


def test_without_redis_health_says_so(router: RouterServer) -> None:
    body = health(router)
    if REDIS_URL:
        assert body["redis"] == "ok", body
    else:
        assert body["redis"] == "not configured" and body["status"] == "ok", body
