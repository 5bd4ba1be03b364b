"""The events page's reading of the log: filters from the query string (nonsense dropped
with a message, never a 500), the query they make, each event's severity, the kinds and
actors offered, and what an event changed field by field."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.http import QueryDict
from django.utils import timezone

from controlpanel.console import event_log
from controlpanel.console.event_log import Change, event_changes, event_filters, events_query
from controlpanel.registry.choices import EventKind, WorkerSource
from controlpanel.registry.models import Event, Worker
from tests.support.in_process import staff_client

pytestmark = pytest.mark.django_db


def event(kind: str, message: str = "", **fields: Any) -> Event:
    return Event.objects.create(kind=kind, message=message, **fields)


def found(query: str) -> list[str]:
    return [e.message for e in events_query(event_filters(QueryDict(query))).order_by("pk")]


def test_severity_is_the_kinds_and_a_rollouts_new_states() -> None:
    assert event_log.severity(Event(kind=EventKind.WORKER_OFFLINE)) == "bad"
    assert event_log.severity(Event(kind=EventKind.WORKER_BACK)) == "ok"
    assert event_log.severity(Event(kind=EventKind.ROLLOUT, data={"to": "rolled_back"})) == "bad"
    assert event_log.severity(Event(kind=EventKind.ROLLOUT, data={"to": "running"})) == "info"
    assert event_log.severity(Event(kind=EventKind.ROLLOUT, data=None)) == "info"
    assert event_log.severity(Event(kind=EventKind.POLICY_CHANGED)) == "info"


def test_filters_by_severity_kind_worker_actor_and_text() -> None:
    one = Worker.objects.create(url="http://127.0.0.1:9", name="gpu-7", models=[],
                                source=WorkerSource.OPERATOR)  # fmt: skip
    event(EventKind.WORKER_OFFLINE, "down", worker=one)
    event(EventKind.ROLLOUT, "rb", data={"to": "rolled_back"})
    event(EventKind.ROLLOUT, "step", data={"to": "running"})
    event(EventKind.POLICY_CHANGED, "policy", actor="user:ann")
    assert found("severity=bad") == ["down", "rb"]
    assert found("severity=info") == ["step", "policy"]
    assert found(f"kind={EventKind.ROLLOUT}&kind={EventKind.POLICY_CHANGED}") == [
        "rb", "step", "policy",
    ]  # fmt: skip
    assert found(f"worker={one.pk}") == ["down"] and found("q=GPU-7") == ["down"]
    assert found("actor=user:ann") == ["policy"] and found("q=ann") == ["policy"]
    first = Event.objects.order_by("pk").first()
    assert first is not None and found(f"after={first.pk}") == ["rb", "step", "policy"]


def test_time_filters_in_the_deployments_zone() -> None:
    old = event(EventKind.POLICY_CHANGED, "old")
    Event.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=2))
    event(EventKind.POLICY_CHANGED, "new")
    assert found("since=1h") == ["new"] and found("since=6h") == ["old", "new"]
    an_hour_ago = (timezone.localtime() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert found(f"from={an_hour_ago}") == ["new"] and found(f"to={an_hour_ago}") == ["old"]


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("kind=worker_exploded", "No event kind 'worker_exploded'"),
        ("severity=awful", "No severity 'awful'"),
        ("since=1y", "No time range '1y'"),
        ("worker=abc", "Worker 'abc' is not a number"),
        ("after=-1", "After '-1' is not a number"),
        ("before=99999999999999999999", "Before '99999999999999999999' is not a number"),
        ("worker=%C2%B2", "Worker '²' is not a number"),
        ("after=%D9%A3", "After '٣' is not a number"),
        ("from=yesterday", "From: 'yesterday' is not a date and time"),
    ],
)
def test_nonsense_is_dropped_with_a_message(query: str, says: str) -> None:
    event(EventKind.POLICY_CHANGED, "kept")
    filters = event_filters(QueryDict(query))
    assert any(says in error for error in filters.errors), filters.errors
    assert not filters.active
    assert [e.message for e in events_query(filters)] == ["kept"]


def test_the_events_page_never_fails_on_a_query_it_cannot_read() -> None:
    event(EventKind.POLICY_CHANGED, "kept")
    page = staff_client().get("/events/", {"worker": "²", "after": "٣"})
    assert page.status_code == 200
    assert "is not a number; that filter is left out." in page.content.decode()


def test_kinds_and_actors_offered_are_those_in_the_log() -> None:
    event(EventKind.WORKER_JOINED, actor="agent")
    event(EventKind.POLICY_CHANGED, actor="user:ann")
    event(EventKind.POLICY_CHANGED, actor="")
    assert event_log.actors() == ["user:ann", "agent"]
    offered = [k for k, _ in event_log.kinds(also=[EventKind.ROLLOUT])]
    assert set(offered) == {EventKind.WORKER_JOINED, EventKind.POLICY_CHANGED, EventKind.ROLLOUT}
    assert event_log.latest_event_id() == Event.objects.order_by("-pk").first().pk  # type: ignore[union-attr]


def test_an_events_changes_field_by_field() -> None:
    made = Event(message="created", data={"before": {}, "after": {"name": "k", "rpm": None}})
    assert event_changes(made) == [Change("name", None, "k")]
    gone = Event(message="removed", data={"before": {"name": "k"}, "after": {}})
    assert event_changes(gone) == [Change("name", "k", None)]
    moved = Event(message="x", data={"before": {"state": "running", "a": 1},
                                     "after": {"state": "rolled_back", "a": 1}})  # fmt: skip
    assert event_changes(moved) == [Change("state", "running", "rolled back")]
    said = Event(message="rpm 1 → 2", data={"before": {"rpm": 1}, "after": {"rpm": 2}})
    assert event_changes(said) == []
    assert event_changes(Event(message="", data=["not", "a", "dict"])) == []
