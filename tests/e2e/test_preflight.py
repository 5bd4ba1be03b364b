"""Pool preflight: a worker unlike the rest of its model's pool is shown, field by field,
and with preflight "refuse" kept out of rotation until it matches or is accepted. Real
router, simulated workers with their own versions and cache configurations, real probes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from controlpanel.fleet import health, services
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, Worker
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def pool(
    router: RouterServer, simulator: StartSimulator, odd: dict[str, Any]
) -> tuple[list[RunningSimulator], list[Worker]]:
    """Three workers of model m; the third started with `odd` settings."""
    sims = [simulator("m"), simulator("m"), simulator("m", **odd)]
    workers = [services.worker_add(url=s.url, name=f"w{i}", actor="t") for i, s in enumerate(sims)]
    router.wait_routable(*workers[:2])
    return sims, workers


def api_worker(router: RouterServer, worker: Worker) -> dict[str, Any]:
    answer = router.get(f"/api/workers/{worker.pk}", headers=ADMIN_HEADERS)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def served_by(sims: list[RunningSimulator], router: RouterServer, n: int) -> list[int]:
    got = []
    for i in range(n):
        before = [s.state.received for s in sims]
        body = {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1}
        assert (
            httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30).status_code
            == 200
        )
        got += [k for k, s in enumerate(sims) if s.state.received > before[k]]
    return got


def test_a_different_version_and_context_length_are_shown_field_by_field(
    router: RouterServer, simulator: StartSimulator
) -> None:
    _, workers = pool(router, simulator, {"version": "0.11.1", "max_model_len": 8192})
    odd = api_worker(router, workers[2])["preflight"]
    texts = [x["text"] for x in odd["mismatches"]["m"]]
    assert texts == ["version 0.11.1 vs pool sim", "max_model_len 8192 vs pool 4096"]
    assert odd["unaccepted"] == ["m"] and odd["refused_by"] == []  # warn: shown, still routed
    assert api_worker(router, workers[0])["preflight"]["mismatches"] == {}
    event = Event.objects.filter(kind=EventKind.PREFLIGHT, worker=workers[2]).get()
    assert "version 0.11.1 vs pool sim" in event.message
    router.wait_routable(workers[2])


def test_a_cache_block_size_seen_by_the_probe_differs(
    router: RouterServer, simulator: StartSimulator
) -> None:
    _, workers = pool(router, simulator, {"block_size": 32})
    assert api_worker(router, workers[2])["preflight"]["mismatches"] == {}  # not probed: unknown
    health.workers_probe()  # reads vllm:cache_config_info, then compares the pools again
    texts = [x["text"] for x in api_worker(router, workers[2])["preflight"]["mismatches"]["m"]]
    assert texts == ["block_size 32 vs pool 16"]


def test_refuse_keeps_the_odd_worker_out_until_accepted(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, workers = pool(router, simulator, {"version": "0.11.1"})
    router.wait_routable(workers[2])
    patched = httpx.patch(
        f"{router.url}/api/models/m", json={"preflight": "refuse"}, headers=ADMIN_HEADERS
    )
    assert patched.status_code == 200 and patched.json()["preflight"] == "refuse", patched.text
    assert api_worker(router, workers[2])["preflight"]["refused_by"] == ["m"]
    wait_until(lambda: 2 not in served_by(sims, router, 6))  # the routers applied it
    assert 2 not in served_by(sims, router, 15)
    accepted = router.post(f"/api/workers/{workers[2].pk}/preflight/accept", headers=ADMIN_HEADERS)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["preflight"]["refused_by"] == []
    wait_until(lambda: 2 in served_by(sims, router, 9))  # back in rotation
    assert Event.objects.filter(
        kind=EventKind.PREFLIGHT, message__startswith="differences accepted"
    ).exists()
    bad = httpx.patch(
        f"{router.url}/api/models/m", json={"preflight": "sometimes"}, headers=ADMIN_HEADERS
    )
    assert bad.status_code == 422
