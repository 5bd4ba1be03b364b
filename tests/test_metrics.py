"""GET /metrics on the router: its own traffic, the fleet it sees, and passive failures."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.registry.models import RoutingGeneration, ServedModel, Worker, WorkerSource
from routing.asgi_types import Message
from routing.metrics import CONTENT_TYPE, PlainHistogram
from routing.proxy import RouterApp, RouterConfig
from routing.snapshot import ModelEntry, WorkerView, build_snapshot
from tests.conftest import AddWorker, RouterServer, StartSimulator, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
REQUESTS = "controlpanel_router_requests_total"
TTFT = "controlpanel_router_ttft_seconds"
DURATION = "controlpanel_router_request_duration_seconds"


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(router: RouterServer) -> Samples:
    response = router.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def scrape_until(router: RouterServer, predicate: Callable[[Samples], bool]) -> Samples:
    """A request is recorded just after its last byte is sent: poll rather than race it."""
    found: list[Samples] = []

    def check() -> bool:
        found[:] = [scrape(router)]
        return predicate(found[0])

    wait_until(check)
    return found[0]


def chat(router: RouterServer, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return router.post("/v1/chat/completions", json=body)


# --- through the real router ----------------------------------------------------------------


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


def fake_worker(url: str, model: str) -> Worker:
    """A registry row pointing at nothing (no discovery), as in test_router_errors."""
    worker = Worker.objects.create(
        url=url, name=url, source=WorkerSource.OPERATOR, models=[{"id": model}]
    )
    ServedModel.objects.get_or_create(name=model)
    RoutingGeneration.bump()
    return worker


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


# --- in-process -------------------------------------------------------------------------


def worker_view(worker_id: int, name: str, url: str, model: str, **extra: Any) -> WorkerView:
    fields: dict[str, Any] = {
        "id": worker_id,
        "name": name,
        "url": url,
        "state": "active",
        "source": "operator",
        "models": (ModelEntry(id=model),),
        "queue_length": None,
        "last_heartbeat": None,
        "routable": True,
        **extra,
    }
    return WorkerView(**fields)


def app_with(*workers: WorkerView, config: RouterConfig | None = None) -> RouterApp:
    app = RouterApp(config)
    app.install(build_snapshot(workers=workers, served_models=(), generation=1))
    return app


def test_fleet_gauges_are_left_to_the_exporting_router() -> None:
    app = app_with(
        worker_view(1, "w1", "http://w1", "m", metrics={"running": 1, "waiting": None}),
        worker_view(2, "w2", "http://w2", "m", routable=False, state="draining"),
    )
    app.inflight[1] = 3

    exported = parse(app.render_metrics().decode())
    assert value(exported, "controlpanel_worker_running", worker="w1") == 1
    assert "controlpanel_worker_waiting" not in names(exported)
    assert value(exported, "controlpanel_worker_up", worker="w2") == 0
    assert value(exported, "controlpanel_worker_state", worker="w2", state="draining") == 1

    app.exports_fleet_metrics = False
    left = parse(app.render_metrics().decode())
    assert not {n for n in names(left) if n.startswith("controlpanel_worker_")}
    # This process's own figures stay: they are summed across replicas.
    assert value(left, "controlpanel_router_inflight", worker="w1") == 3
    assert value(left, "controlpanel_router_inflight", worker="w2") == 0


def test_workers_sharing_a_name_get_distinct_series() -> None:
    app = app_with(
        worker_view(1, "gpu", "http://a", "m", metrics={"running": 1}),
        worker_view(2, "gpu", "http://b", "m", metrics={"running": 2}),
    )
    samples = parse(app.render_metrics().decode())
    assert value(samples, "controlpanel_worker_running", worker="gpu#1") == 1
    assert value(samples, "controlpanel_worker_running", worker="gpu#2") == 2


def test_histogram_buckets_are_inclusive_upper_bounds() -> None:
    histogram = PlainHistogram((0.1, 1.0))
    for observed in (0.1, 0.5, 1.0, 7.0):
        histogram.observe(observed)
    assert histogram.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert histogram.total == pytest.approx(8.6)


async def call(app: RouterApp, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request through the ASGI callable; the client stays connected throughout."""
    sent: list[Message] = []
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Listens but never accepts: the connection is made, no answer ever comes."""
    server = socket.create_server(("127.0.0.1", 0), backlog=8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_passive_failures_are_recorded_and_taken(silent_server: str) -> None:
    refused = worker_view(1, "refused", f"http://127.0.0.1:{free_port()}", "a")
    silent = worker_view(2, "silent", silent_server, "b")
    app = app_with(refused, silent, config=RouterConfig(connect_timeout=1, read_timeout=0.3))

    def chat_body(model: str) -> bytes:
        return orjson.dumps({"model": model, "messages": []})

    async def scenario() -> list[int]:
        try:
            return [
                (await call(app, "POST", "/v1/chat/completions", chat_body(model)))[0]
                for model in ("a", "b", "a")
            ]
        finally:
            await app.shutdown()

    assert asyncio.run(scenario()) == [502, 504, 502]
    taken = app.take_passive_failures()
    assert set(taken) == {1, 2}
    assert taken[1][0] == 2 and taken[1][1].startswith("connect: ClientConnectorError")
    assert taken[2][0] == 1 and taken[2][1].startswith("timeout: ")
    assert app.take_passive_failures() == {}

    samples = parse(app.render_metrics().decode())
    errors = "controlpanel_router_upstream_errors_total"
    assert value(samples, errors, worker="refused", kind="connect") == 2
    assert value(samples, errors, worker="silent", kind="timeout") == 1
    assert value(samples, REQUESTS, model="a", worker="refused", status="502") == 2
    assert value(samples, REQUESTS, model="b", worker="silent", status="504") == 1


def test_metrics_endpoint_and_router_made_statuses_in_process() -> None:
    app = app_with(worker_view(1, "w1", "http://w1", "m", routable=False))

    async def scenario() -> dict[str, int]:
        return {
            "405": (await call(app, "GET", "/v1/chat/completions"))[0],
            "503": (await call(app, "POST", "/v1/completions", b'{"model": "m"}'))[0],
        }

    assert asyncio.run(scenario()) == {"405": 405, "503": 503}
    status, text = asyncio.run(call(app, "GET", "/metrics"))
    assert status == 200
    samples = parse(text.decode())
    assert value(samples, REQUESTS, model="", worker="", status="405") == 1
    assert value(samples, REQUESTS, model="m", worker="", status="503") == 1
    # Rejected before any worker was chosen: counted, but not timed.
    assert f"{DURATION}_count" not in names(samples)


@pytest.mark.django_db
def test_only_the_longest_running_router_exports_the_fleet() -> None:
    from datetime import datetime, timedelta

    from django.utils import timezone

    from controlpanel.registry.models import RouterInstance
    from controlpanel.routers import reports
    from routing.ports import RouterReport

    now = timezone.now()
    # Only this test's routers: the session's router may be reporting into this database.
    RouterInstance.objects.all().delete()

    def report(instance: str, started: datetime) -> bool:
        return reports.router_report(
            report=RouterReport(
                instance_id=instance, hostname="h", pid=1, started_at=started.timestamp(),
                generation=0, inflight={},
            )
        )  # fmt: skip

    assert report("old", now - timedelta(minutes=5)) is True
    assert report("new", now) is False
    assert report("old", now - timedelta(minutes=5)) is True
    reports.router_forget(instance_id="old")
    assert report("new", now) is True  # the exporter left: the next one takes over
