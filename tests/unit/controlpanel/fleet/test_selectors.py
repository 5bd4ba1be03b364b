"""Read queries over the fleet (controlpanel.fleet.selectors): who serves what, which models
only one routable worker serves, and what every live router has in flight on a worker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from controlpanel.fleet import selectors
from controlpanel.registry.choices import WorkerSource, WorkerState
from controlpanel.registry.models import ROUTER_LIVENESS, RouterInstance, Worker
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db


def add(name: str, *models: str, **fields: object) -> Worker:
    fields.setdefault("source", WorkerSource.OPERATOR)
    return Worker.objects.create(
        url=f"http://{name}:8000", name=name, models=[{"id": m} for m in models], **fields
    )


def test_workers_by_model_counts_bases_and_adapters() -> None:
    a = add("a", "base", "lora")
    b = add("b", "base")
    assert selectors.workers_by_model() == {"base": [a.pk, b.pk], "lora": [a.pk]}


def test_sole_models_are_those_no_other_routable_worker_serves() -> None:
    a = add("a", "base", "lora", "solo")
    add("b", "base")
    add("c", "lora", state=WorkerState.DRAINING)  # not routable: covers nothing
    add("d", "solo", sleeping=True)
    assert selectors.worker_sole_models(a) == ["lora", "solo"]
    unhealthy = add("e", "only-here", state=WorkerState.UNHEALTHY)
    assert selectors.worker_sole_models(unhealthy) == []  # out already: taking it changes nothing


def test_an_agents_silent_worker_covers_nothing() -> None:
    a = add("a", "m")
    stale = timezone.now() - timedelta(seconds=settings.CONTROLPANEL_HEARTBEAT_EXPIRY + 1)
    add("b", "m", source=WorkerSource.AGENT, last_heartbeat=stale)
    assert selectors.worker_sole_models(a) == ["m"]
    Worker.objects.filter(name="b").update(last_heartbeat=timezone.now())
    assert selectors.worker_sole_models(a) == []


def test_inflight_is_summed_over_live_routers_only() -> None:
    routers_only_this_tests()
    now = timezone.now()
    for name, seen, inflight in (
        ("r1", now, {"7": 2, "8": 1}),
        ("r2", now, {"7": 3}),
        ("gone", now - 2 * ROUTER_LIVENESS, {"7": 100}),
    ):
        RouterInstance.objects.create(
            instance_id=name, hostname="h", pid=1, started_at=seen, last_seen=seen,
            inflight=inflight,
        )  # fmt: skip
    assert selectors.worker_inflight(7) == 5
    assert selectors.worker_inflight(9) == 0
