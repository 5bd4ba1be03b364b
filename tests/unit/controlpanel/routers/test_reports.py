"""What routers report back (controlpanel.routers.reports), on the database: the router's
row, failures and ejections turned into health and events, drains finished, traffic that
degrades a worker, and the sums the console shows over every live router."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from controlpanel.fleet import services
from controlpanel.registry.choices import EventKind, WorkerState
from controlpanel.registry.models import ROUTER_LIVENESS, Event, RouterInstance, Worker
from controlpanel.routers import reports
from routing.ports import RouterReport
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Router instance ids of this test's own (their traffic history lives in the process),
    and no other router's rows."""
    routers_only_this_tests()
    made: list[str] = []
    yield made
    for instance_id in made:
        reports.router_forget(instance_id=instance_id)


@pytest.fixture
def worker() -> Worker:
    return Worker.objects.create(
        url="http://10.0.0.1:8000", name="w1", source="operator", models=[{"id": "m"}]
    )


def send(names: list[str], index: int = 0, **fields: Any) -> bool:
    while len(names) <= index:
        names.append(f"router-{uuid.uuid4().hex[:8]}")
    fields.setdefault("inflight", {})
    fields.setdefault("generation", 0)
    fields.setdefault("started_at", time.time() - 100 + index)  # the first one is the oldest
    return reports.router_report(
        report=RouterReport(instance_id=names[index], hostname="h", pid=100 + index, **fields)
    )


def test_the_oldest_live_router_exports_the_fleet_and_stale_rows_go(
    names: list[str], worker: Worker
) -> None:
    long_gone = timezone.now() - ROUTER_LIVENESS * 21
    RouterInstance.objects.create(
        instance_id="gone", hostname="h", pid=1, started_at=long_gone, last_seen=long_gone
    )
    # alone (the other row is long gone), the first router exports; then the older one does
    assert send(names, 1, inflight={worker.pk: 2, 99: 0}, recent={worker.pk: (3, 1), 98: (0, 0)})
    assert send(names, 0) is True and send(names, 1) is False
    row = RouterInstance.objects.get(instance_id=names[1])
    assert row.inflight == {} and row.recent == {}  # the last report replaced the first's
    assert not RouterInstance.objects.filter(instance_id="gone").exists()
    send(names, 1, inflight={worker.pk: 2, 99: 0}, recent={worker.pk: (3, 1), 98: (0, 0)})
    row.refresh_from_db()
    assert row.inflight == {str(worker.pk): 2} and row.recent == {str(worker.pk): [3, 1]}


def test_refused_connections_make_a_worker_unhealthy_and_ejections_are_logged(
    names: list[str], worker: Worker
) -> None:
    ejections = [
        (worker.pk, "ejected", "5 failures"),
        (worker.pk, "wandered", "unknown kind"),
        (worker.pk + 1000, "ejected", "unknown worker"),
    ]
    send(names, failures={worker.pk: (1, "connect: refused")}, ejections=ejections)
    assert Worker.objects.get(pk=worker.pk).state == WorkerState.UNHEALTHY
    logged = Event.objects.filter(actor="router").values_list("kind", "message")
    assert set(logged) >= {(EventKind.WORKER_EJECTED, "5 failures")}
    assert not Event.objects.filter(message__in=["unknown kind", "unknown worker"]).exists()


def test_a_report_with_nothing_in_flight_finishes_a_drain(names: list[str], worker: Worker) -> None:
    Worker.objects.create(url="http://10.0.0.2:8000", name="w2", source="operator")
    send(names, inflight={worker.pk: 1})
    drained = services.worker_drain(worker_id=worker.pk, actor="ops")
    assert drained.state == WorkerState.DRAINING
    send(names, generation=drained.drain_generation, inflight={worker.pk: 1})
    assert Worker.objects.get(pk=worker.pk).state == WorkerState.DRAINING
    send(names, generation=drained.drain_generation)
    assert Worker.objects.get(pk=worker.pk).state == WorkerState.DRAINED


def test_failing_real_traffic_degrades_a_worker_its_probes_call_healthy(
    names: list[str], worker: Worker
) -> None:
    enough = settings.CONTROLPANEL_DEGRADED_MIN_REQUESTS
    failed = int(enough * settings.CONTROLPANEL_DEGRADED_ERROR_RATE) + 1
    failed = min(failed, enough)
    send(names, totals={worker.pk: (enough, failed)})  # a young router: counted from zero
    degraded = Worker.objects.get(pk=worker.pk)
    assert degraded.state == WorkerState.DEGRADED
    assert degraded.degraded_reason.startswith(f"{failed} of {enough} requests failed")
    window = RouterInstance.objects.get(instance_id=names[0]).window
    assert window[str(worker.pk)][:2] == [enough, failed]


def test_classes_and_fallbacks_are_summed_over_live_routers(names: list[str]) -> None:
    send(
        names,
        0,
        classes={"m": {"queued": [1, 2, 3], "admitted": [10, 20, 30], "shed": [0, 0, 5, 99]}},
        fallbacks=[("m", "n", "no worker", 2), ("m", "o", "5xx", 1)],
    )
    send(names, 1, classes={"m": {"queued": [1, 0, 0]}}, fallbacks=[("m", "n", "5xx", 3)])
    stale = timezone.now() - ROUTER_LIVENESS * 2
    RouterInstance.objects.create(
        instance_id="stale", hostname="h", pid=1, started_at=stale, last_seen=stale,
        classes={"m": {"queued": [100, 0, 0]}}, fallbacks=[["m", "n", "x", 100]],
    )  # fmt: skip
    assert reports.model_classes() == {
        "m": [
            {"name": "critical", "queued": 2, "admitted": 10, "shed": 0},
            {"name": "standard", "queued": 2, "admitted": 20, "shed": 0},
            {"name": "sheddable", "queued": 3, "admitted": 30, "shed": 5},
        ]
    }
    assert reports.fallback_counts() == {"m": {"n": 5, "o": 1}}


def test_kv_streams_as_every_live_router_sees_them(names: list[str], worker: Worker) -> None:
    stream = {"state": "subscribed", "blocks": 12}
    send(names, 0, kv_events={worker.pk: stream})
    send(names, 1)
    assert reports.worker_kv_streams(worker_id=worker.pk) == [{"router": "h:100", **stream}]
    reports.router_forget(instance_id=names[0])
    assert reports.worker_kv_streams(worker_id=worker.pk) == []
    assert not RouterInstance.objects.filter(instance_id=names[0]).exists()
