"""The registry's models (controlpanel.registry.models): the one routable rule, the routing
generation and its announcement after commit, router liveness and a plan's hold."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.registry.choices import RolloutState, WorkerSource, WorkerState
from controlpanel.registry.models import (
    Alias,
    Event,
    RolloutPlan,
    RouterInstance,
    RoutingGeneration,
    Worker,
)
from controlpanel.registry.signals import routing_committed
from tests.support.router_rows import routers_only_this_tests

NOW = timezone.now()
EXPIRY = 90


def worker(**fields: Any) -> Worker:
    fields.setdefault("source", WorkerSource.OPERATOR)
    return Worker(url="http://h:1", name="w", models=[{"id": "a"}, {"id": "b"}], **fields)


@pytest.mark.parametrize(
    ("fields", "degraded_weight", "routable"),
    [
        ({}, 0.0, True),
        ({"state": WorkerState.DRAINING}, 0.0, False),
        ({"state": WorkerState.DEGRADED}, 0.0, False),
        ({"state": WorkerState.DEGRADED}, 0.25, True),
        ({"sleeping": True}, 0.0, False),
        ({"sleeping": None}, 0.0, True),  # unknown is not asleep
        ({"source": WorkerSource.AGENT, "last_heartbeat": None}, 0.0, False),
        ({"source": WorkerSource.AGENT, "last_heartbeat": NOW - timedelta(seconds=60)}, 0.0, True),
        ({"source": WorkerSource.AGENT, "last_heartbeat": NOW - timedelta(seconds=91)}, 0.0, False),
        ({"last_heartbeat": NOW - timedelta(days=9)}, 0.0, True),  # only agents promise beats
    ],
)
def test_the_one_routable_rule(
    fields: dict[str, Any], degraded_weight: float, routable: bool
) -> None:
    assert worker(**fields).is_routable(EXPIRY, NOW, degraded_weight) is routable


def test_a_degraded_worker_keeps_a_share_of_its_weight() -> None:
    assert worker(weight=2.0).routing_weight(0.25) == 2.0
    assert worker(weight=2.0, state=WorkerState.DEGRADED).routing_weight(0.25) == 0.5
    assert worker().model_ids == ["a", "b"]
    assert worker(last_heartbeat=NOW - timedelta(seconds=5)).heartbeat_age(NOW) == 5.0


@pytest.mark.django_db
def test_the_generation_moves_by_one_and_is_announced_only_on_commit(
    django_capture_on_commit_callbacks: Any,
) -> None:
    heard: list[object] = []

    def listener(**_: object) -> None:
        heard.append(True)

    routing_committed.connect(listener)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            RoutingGeneration.bump()  # a fresh row: starts at a random point
            first = RoutingGeneration.current()
            RoutingGeneration.bump()
            assert heard == []
        assert RoutingGeneration.current() == first + 1
        assert len(heard) == 2
    finally:
        routing_committed.disconnect(listener)
    deployment = RoutingGeneration.deployment_id()
    assert len(deployment) == 32
    RoutingGeneration.bump()
    assert RoutingGeneration.deployment_id() == deployment


@pytest.mark.django_db
def test_before_any_change_there_is_no_generation_and_no_identity() -> None:
    RoutingGeneration.objects.all().delete()
    assert (RoutingGeneration.current(), RoutingGeneration.deployment_id()) == (0, "")


@pytest.mark.django_db
def test_live_routers_are_those_seen_recently() -> None:
    routers_only_this_tests()
    for name, age in (("fresh", 1), ("old", 60)):
        seen = timezone.now() - timedelta(seconds=age)
        RouterInstance.objects.create(
            instance_id=name, hostname="h", pid=1, started_at=seen, last_seen=seen
        )
    live = RouterInstance.live(timedelta(seconds=15)).values_list("instance_id", flat=True)
    assert list(live) == ["fresh"]


def test_a_plans_hold_runs_only_while_running() -> None:
    steps = [{"weight": 10, "hold_seconds": 60}, {"weight": 100, "hold_seconds": 0}]
    plan = RolloutPlan(steps=steps, state=RolloutState.SCHEDULED)
    assert plan.current_step is None and plan.hold_left(NOW) is None
    plan.state, plan.step_index = RolloutState.RUNNING, 0
    plan.step_started_at = NOW - timedelta(seconds=45)
    assert plan.current_step == steps[0] and plan.hold_left(NOW) == 15.0
    assert plan.hold_left(NOW + timedelta(hours=1)) == 0.0  # over: never negative
    plan.state, plan.paused_remaining = RolloutState.PAUSED, 12.5
    assert plan.hold_left(NOW + timedelta(hours=1)) == 12.5  # paused: the clock stands
    plan.step_index = 5
    assert plan.current_step is None


@pytest.mark.django_db
def test_an_event_outlives_its_worker_and_reads_as_a_dict() -> None:
    row = Worker.objects.create(url="http://h:1", name="w", source=WorkerSource.OPERATOR)
    event = Event.objects.create(kind="worker_joined", worker=row, subject=row.url, actor="ops")
    row.delete()
    event.refresh_from_db()
    shown = event.as_dict()
    assert shown["worker_id"] is None and shown["subject"] == "http://h:1"
    assert shown["at"] == event.created_at.isoformat()
    assert str(Alias(name="chat")) == "chat"
