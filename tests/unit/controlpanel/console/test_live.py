"""The live feed's diffing: the first read sends every row, an unchanged fleet sends
nothing, then only what changed (a row, a removal, the newest event's id, a rollout);
a page that (re)connects gets everything; a nudge without Redis is a quiet no-op."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.console import live
from controlpanel.registry.choices import RolloutState, WorkerSource
from controlpanel.registry.models import Alias, Event, RolloutPlan, RouterInstance, Worker

# changes() closes old connections, as a thread of its own would: no test transaction.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def a_router_live_throughout() -> None:
    """A row's requests per second read "unknown" while no router is live and 0 once one is:
    the session's router (started by an end-to-end test earlier in this process) may report
    between two reads and change every row. One live router from the start, and live to the
    end however slow the machine, keeps the rows as the test changes them; the flush after
    the test removes it."""
    now = timezone.now()
    RouterInstance.objects.create(
        instance_id="test-live", hostname="test", pid=1, started_at=now,
        last_seen=now + timedelta(hours=1),
    )  # fmt: skip


def worker(name: str, model: str = "m") -> Worker:
    return Worker.objects.create(
        url=f"http://127.0.0.1:9/{name}", name=name, models=[{"id": model}],
        source=WorkerSource.OPERATOR, last_heartbeat=timezone.now(),
    )  # fmt: skip


def read(publisher: live.LivePublisher) -> dict[str, Any] | None:
    text = publisher.changes()
    return None if text is None else json.loads(text)


def test_only_what_changed_is_sent() -> None:
    a, b = worker("gpu-a"), worker("gpu-b", "other")  # b's row never depends on a's
    publisher = live.LivePublisher()
    first = read(publisher)
    assert first is not None
    assert set(first["rows"]) == {str(a.pk), str(b.pk)} and "gpu-a" in first["rows"][str(a.pk)]
    assert first["order"] == [a.pk, b.pk] and first["removed"] == []
    assert read(publisher) is None

    Worker.objects.filter(pk=a.pk).update(state="offline", updated_at=timezone.now())
    changed = read(publisher)
    assert changed is not None and set(changed["rows"]) == {str(a.pk)}
    assert "gpu-a offline" in changed["problems"]

    Worker.objects.filter(pk=b.pk).delete()
    gone = read(publisher)
    assert gone is not None and gone["removed"] == [b.pk] and gone["rows"] == {}


def test_a_new_event_and_a_moved_rollout_are_sent() -> None:
    publisher = live.LivePublisher()
    read(publisher)
    event = Event.objects.create(kind="policy_changed", message="x")
    assert read(publisher) == {"events": event.pk}
    alias = Alias.objects.create(name="chat", targets={"m": 100})
    plan = RolloutPlan.objects.create(alias=alias, from_target="m", to_target="n", steps=[],
                                      state=RolloutState.SCHEDULED)  # fmt: skip
    moved = read(publisher)
    assert moved is not None and set(moved["rollouts"]) == {str(plan.pk)}
    assert set(moved["rollouts"][str(plan.pk)]) == {"row", "panel"}
    assert read(publisher) is None


def test_a_reconnecting_page_gets_everything() -> None:
    a = worker("gpu-a")
    message = json.loads(live.full_message())
    assert message["full"] is True and set(message["rows"]) == {str(a.pk)}
    assert message["events"] == 0 and message["rollouts"] == {}


def test_subscribers_count_dashboards_in_and_out() -> None:
    publisher = live.LivePublisher()
    publisher.subscribers = 2
    assert publisher._watched.is_set()
    publisher.subscribers = 0
    assert not publisher._watched.is_set()


def test_a_nudge_without_redis_does_nothing(settings: pytest.FixtureRequest) -> None:
    settings.REDIS_URL = ""  # type: ignore[attr-defined]
    live.nudge_dashboards()
    live.nudge_on_commit(sender=None)
