"""GET /metrics on the real router: its own traffic, a refused connection, and the fleet it sees."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from controlpanel.registry.models import RoutingGeneration, Worker
from tests.support.fake_workers import fake_worker
from tests.support.metrics import (
    DURATION,
    REQUESTS,
    TTFT,
    Samples,
    scrape,
    scrape_until,
    value,
)
from tests.support.servers import AddWorker, RouterServer, StartSimulator, free_port

pytestmark = pytest.mark.django_db(transaction=True)


def chat(router: RouterServer, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return router.post("/v1/chat/completions", json=body)


def test_router_counts_and_times_its_own_traffic(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("metrics-m"))
    before = scrape(router)

    def delta(samples: Samples, name: str, **labels: str) -> float:
        return (value(samples, name, **labels) or 0) - (value(before, name, **labels) or 0)

    for _ in range(3):
        assert chat(router, "metrics-m", max_tokens=2).status_code == 200
    body = {"model": "metrics-m", "prompt": "x", "max_tokens": 3, "stream": True}
    for _ in range(2):
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert b"data: [DONE]" in response.read()
    assert chat(router, "metrics-no-such-model").status_code == 404
    assert router.post("/v1/chat/completions", content=b"{not json").status_code == 400

    ok = {"model": "metrics-m", "worker": worker.name, "status": "200"}
    after = scrape_until(router, lambda s: delta(s, REQUESTS, **ok) == 5)
    # Router-made errors: no worker was chosen, and an unknown model name is no label.
    assert delta(after, REQUESTS, model="", worker="", status="404") == 1
    assert delta(after, REQUESTS, model="", worker="", status="400") == 1
    for histogram in (TTFT, DURATION):
        assert delta(after, f"{histogram}_count", model="metrics-m") == 5
        assert delta(after, f"{histogram}_bucket", model="metrics-m", le="+Inf") == 5
        assert delta(after, f"{histogram}_sum", model="metrics-m") > 0
    ttft_sum = delta(after, f"{TTFT}_sum", model="metrics-m")
    assert ttft_sum <= delta(after, f"{DURATION}_sum", model="metrics-m")
    assert value(after, "controlpanel_router_inflight", worker=worker.name) == 0


def test_connection_refused_is_counted_as_a_502_and_a_connect_error(
    router: RouterServer,
) -> None:
    worker = fake_worker(f"http://127.0.0.1:{free_port()}", "metrics-dead")
    router.wait_routable(worker)
    assert chat(router, "metrics-dead").status_code == 502

    failed = {"model": "metrics-dead", "worker": worker.name, "status": "502"}
    after = scrape_until(router, lambda s: value(s, REQUESTS, **failed) == 1)
    errors = "controlpanel_router_upstream_errors_total"
    assert (value(after, errors, worker=worker.name, kind="connect") or 0) >= 1
    # Forwarded, so timed; but no byte came from the worker, so no time to first byte.
    assert value(after, f"{DURATION}_count", model="metrics-dead") == 1
    assert value(after, f"{TTFT}_count", model="metrics-dead") is None


def test_worker_gauges_follow_the_registry(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("metrics-fleet"))
    scraped = {
        "running": 2,
        "waiting": None,
        "kv_cache_usage": 0.25,
        "prefix_hit_rate": 0.5,
        "ttft_p50": 0.12,
        "ttft_p95": None,
        "rps": 3.5,
    }
    Worker.objects.filter(pk=worker.pk).update(metrics=scraped, queue_length=4)
    RoutingGeneration.bump()

    kv = "controlpanel_worker_kv_cache_usage"
    after = scrape_until(router, lambda s: value(s, kv, worker=worker.name) == 0.25)
    name = worker.name
    assert value(after, "controlpanel_worker_running", worker=name) == 2
    assert value(after, "controlpanel_worker_prefix_hit_rate", worker=name) == 0.5
    assert value(after, "controlpanel_worker_ttft_p50_seconds", worker=name) == 0.12
    assert value(after, "controlpanel_worker_rps", worker=name) == 3.5
    assert value(after, "controlpanel_worker_queue_length", worker=name) == 4
    # Unknown is no sample at all, never a zero.
    assert value(after, "controlpanel_worker_waiting", worker=name) is None
    assert value(after, "controlpanel_worker_ttft_p95_seconds", worker=name) is None
    assert value(after, "controlpanel_worker_up", worker=name) == 1
    assert value(after, "controlpanel_worker_state", worker=name, state="active") == 1
    for other in ("draining", "drained", "unhealthy", "offline"):
        assert value(after, "controlpanel_worker_state", worker=name, state=other) == 0
