"""GET /metrics on the router, in process (routing.telemetry.metrics): the fleet it sees,
its own statuses and passive failures, and which router exports the fleet. Through the
real router: tests/e2e/test_metrics.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from routing.asgi_types import Message
from routing.fleet.snapshot import ModelEntry, WorkerView, build_snapshot
from routing.histograms import PlainHistogram
from routing.router import RouterApp
from routing.state import RouterConfig
from tests.support.metrics import (
    DURATION,
    REQUESTS,
    names,
    parse,
    value,
)
from tests.support.servers import free_port

pytestmark = pytest.mark.django_db(transaction=True)


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

    from controlpanel.routers import reports
    from routing.ports import RouterReport
    from tests.support.router_rows import routers_only_this_tests

    now = timezone.now()
    # Only this test's routers: the session's router may be reporting into this database.
    routers_only_this_tests()

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
