"""`previous_response_id` while the routers' shared state is unreachable: a replica that
holds the id in memory still routes it; one that would have to ask Redis answers 503 with
Retry-After and says why, never a guess at another worker; once Redis answers again, the
follow-up reaches the holder. Redis here is a private redis-server, paused with SIGSTOP (a
hung Redis: the lookup times out) and resumed with SIGCONT."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlpanel.registry.models import Worker
from tests.support.replicas import join
from tests.support.servers import (
    RouterServer,
    StartSimulator,
    free_port,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = "resp-model"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: _pings(url))
    yield url
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=30)


def _pings(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def routers(tmp_path: Path, redis_url: str) -> Iterator[list[RouterServer]]:
    started: list[RouterServer] = []
    yield started
    for server in started:
        stop_process(server.proc)


def follow_up(router: RouterServer, previous: str) -> httpx.Response:
    body = {"model": MODEL, "input": "more", "previous_response_id": previous,
            "max_output_tokens": 2}  # fmt: skip
    return httpx.post(f"{router.url}/v1/responses", json=body, timeout=30)


def test_a_replica_that_cannot_ask_redis_says_so_and_never_guesses(
    tmp_path: Path, redis_url: str, routers: list[RouterServer], simulator: StartSimulator
) -> None:
    first = start_router(tmp_path, REDIS_URL=redis_url)
    routers.append(first)
    sims = [simulator(MODEL) for _ in range(3)]
    join(sims, first)
    made = httpx.post(f"{first.url}/v1/responses", json={"model": MODEL, "input": "hi",
                      "max_output_tokens": 2}, timeout=30).json()  # fmt: skip
    late = start_router(tmp_path, REDIS_URL=redis_url)  # has heard of no id
    routers.append(late)
    late.wait_routable(*Worker.objects.all())
    server = _redis_pid(redis_url)
    os.kill(server, signal.SIGSTOP)
    try:
        refused = follow_up(late, made["id"])
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"]
        error = refused.json()["error"]
        assert made["id"] in error["message"] and "Redis" in error["message"]
        assert error["param"] == "previous_response_id"
        # The replica that recorded it needs no Redis to route it.
        assert follow_up(first, made["id"]).status_code == 200
        got = httpx.get(f"{late.url}/v1/responses/{made['id']}", timeout=30)
        assert got.status_code == 503 and got.json()["error"]["param"] == "response_id"
    finally:
        os.kill(server, signal.SIGCONT)
    wait_until(lambda: follow_up(late, made["id"]).status_code == 200, timeout=60)
    status = late.get("/health").json()
    assert status["responses"]["unreachable"] >= 2, status["responses"]


def _redis_pid(url: str) -> int:
    import redis

    return int(redis.Redis.from_url(url).info("server")["process_id"])
