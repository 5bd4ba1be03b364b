"""Health from real traffic (controlpanel.fleet.traffic_health): each router's running totals
windowed by the times given (no clock waited on), summed over live routers, and the
degraded <-> active transitions they drive."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from controlpanel.fleet import traffic_health
from controlpanel.registry.choices import EventKind, WorkerState
from controlpanel.registry.models import ROUTER_LIVENESS, Event, RouterInstance, Worker
from tests.support.router_rows import routers_only_this_tests

RATE = traffic_health.RATE_WINDOW_SECONDS
ENOUGH = settings.CONTROLPANEL_DEGRADED_MIN_REQUESTS


@pytest.fixture
def router_id() -> Iterator[str]:
    instance_id = f"router-{uuid.uuid4().hex[:8]}"
    yield instance_id
    traffic_health.router_history_forget(instance_id=instance_id)


def test_a_young_router_counts_from_its_first_report(router_id: str) -> None:
    """Its history starts at its first report: nothing older to difference."""
    window = traffic_health.router_window(instance_id=router_id, totals={1: (5, 2)}, now=1000.0)
    assert window == {"1": [5, 2, 5]}


def test_the_window_differences_the_totals_at_its_start(router_id: str, settings: Any) -> None:
    settings.CONTROLPANEL_DEGRADED_WINDOW = WINDOW = 30.0  # longer than the rate's window

    def at(now: float, totals: dict[int, tuple[int, int]]) -> dict[str, list[int]]:
        return traffic_health.router_window(instance_id=router_id, totals=totals, now=now)

    t0 = 1000.0
    at(t0, {1: (10, 5), 2: (7, 0)})
    at(t0 + WINDOW - RATE, {1: (40, 6), 2: (7, 0)})
    later = at(t0 + WINDOW + 1, {1: (50, 6), 2: (7, 0)})
    # the degraded window starts after t0: the total kept at its start is t0's
    assert later["1"] == [50 - 10, 6 - 5, 50 - 40]
    assert "2" not in later  # nothing new on worker 2: left out
    quiet = at(t0 + 3 * WINDOW, {1: (50, 6), 2: (7, 0)})
    assert quiet == {}


@pytest.mark.django_db
def test_live_routers_windows_are_summed_and_judged() -> None:
    routers_only_this_tests()
    worker = Worker.objects.create(url="http://10.0.0.1:8000", name="w", source="operator")
    now = timezone.now()
    failing = max(1, int(ENOUGH * settings.CONTROLPANEL_DEGRADED_ERROR_RATE + 0.999))
    half, rest = ENOUGH // 2, ENOUGH - ENOUGH // 2
    rows = {
        "a": ({str(worker.pk): [half, min(failing, half), 1]}, now),
        "b": ({str(worker.pk): [rest, max(0, failing - half), 2]}, now),
        "gone": ({str(worker.pk): [1000, 1000, 0]}, now - 2 * ROUTER_LIVENESS),
    }
    for instance_id, (window, seen) in rows.items():
        RouterInstance.objects.create(
            instance_id=instance_id, hostname="h", pid=1, started_at=seen, last_seen=seen,
            window=window,
        )  # fmt: skip
    assert traffic_health.fleet_window() == {worker.pk: (ENOUGH, failing, 3)}
    assert traffic_health.workers_judge_traffic() == 1
    assert traffic_health.workers_judge_traffic() == 0  # once
    assert Worker.objects.get(pk=worker.pk).state == WorkerState.DEGRADED

    RouterInstance.objects.filter(instance_id__in=["a", "b"]).update(window={})
    Worker.objects.filter(pk=worker.pk).update(consecutive_failures=1)
    assert traffic_health.workers_judge_traffic() == 0  # its probes fail: theirs to decide
    Worker.objects.filter(pk=worker.pk).update(consecutive_failures=0)
    assert traffic_health.workers_judge_traffic() == 1
    back = Worker.objects.get(pk=worker.pk)
    assert (back.state, back.degraded_reason) == (WorkerState.ACTIVE, "")
    kinds = list(Event.objects.order_by("pk").values_list("kind", flat=True))
    assert kinds == [EventKind.WORKER_DEGRADED, EventKind.WORKER_RECOVERED]


@pytest.mark.django_db
def test_too_few_requests_never_condemn() -> None:
    routers_only_this_tests()
    worker = Worker.objects.create(url="http://10.0.0.1:8000", name="w", source="operator")
    now = timezone.now()
    RouterInstance.objects.create(
        instance_id="a", hostname="h", pid=1, started_at=now, last_seen=now,
        window={str(worker.pk): [ENOUGH - 1, ENOUGH - 1, 0]},
    )  # fmt: skip
    assert traffic_health.workers_judge_traffic() == 0
    assert Worker.objects.get(pk=worker.pk).state == WorkerState.ACTIVE
