"""Shortest-queue balancing through the real router."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.utils import timezone

from controlpanel.registry import events
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)


def slow_chat(router: RouterServer) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    return httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=20).status_code


def test_concurrent_requests_spread_evenly(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims = [simulator("m", ttft_ms=400, itl_ms=1, max_batch=64) for _ in range(3)]
    for sim in sims:
        add_worker(sim)
    with ThreadPoolExecutor(max_workers=30) as pool:
        statuses = list(pool.map(lambda _: slow_chat(router), range(30)))
    assert statuses == [200] * 30
    counts = sorted(sim.state.completed for sim in sims)
    assert sum(counts) == 30
    # Each request sees the others in flight, so no worker gets more than its share + 2.
    assert counts[-1] - counts[0] <= 2, counts


def test_reported_queue_length_steers_traffic_away(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    busy_sim, idle_sim = simulator("m"), simulator("m")
    busy = add_worker(busy_sim)
    add_worker(idle_sim)
    busy.queue_length, busy.queue_length_at = 50, timezone.now()  # a fresh report
    busy.save(update_fields=["queue_length", "queue_length_at"])
    events.routing_changed()
    router.wait_for(lambda seen: seen[busy.pk]["queue_length"] == 50)
    for _ in range(10):
        assert slow_chat(router) == 200
    assert busy_sim.state.completed == 0
    assert idle_sim.state.completed == 10
