"""The event log's writer (controlpanel.registry.events): what a row holds, a line logged
only once the change is committed, settings changes with secrets masked, and values the
JSON column can hold."""

from __future__ import annotations

import json
import logging
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest

from controlpanel.registry import events
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, RoutingGeneration, Worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def worker() -> Worker:
    return Worker.objects.create(url="http://10.0.0.1:8000", name="w1", source="operator")


def test_an_event_names_its_worker_or_subject_and_logs_after_commit(
    worker: Worker,
    caplog: pytest.LogCaptureFixture,
    django_capture_on_commit_callbacks: Any,
) -> None:
    caplog.set_level(logging.INFO, logger="controlpanel.events")
    with django_capture_on_commit_callbacks(execute=False) as pending:
        event = events.event_record(
            kind=EventKind.DRAIN_STARTED, worker=worker, message="drain requested", actor="ops"
        )
        other = events.event_record(
            kind=EventKind.MODEL_CHANGED, worker=None, message="m: x", actor="", subject="m"
        )
    assert (event.subject, event.data, other.subject) == (worker.url, {}, "m")
    assert not caplog.records  # nothing said of a change that may still roll back
    for callback in pending:
        callback()
    assert [r.getMessage() for r in caplog.records] == [
        "Drain started w1: drain requested (by ops)",
        "Model changed: m: x",
    ]


def test_a_change_is_logged_with_only_its_fields_and_its_context(worker: Worker) -> None:
    unchanged = events.event_record_change(
        kind=EventKind.WORKER_CHANGED, actor="ops", before={"a": 1}, after={"a": 1}
    )
    assert unchanged is None and not Event.objects.exists()
    event = events.event_record_change(
        kind=EventKind.WORKER_CHANGED,
        actor="ops",
        before={"name": "w1", "weight": 1.0, "api_key": ""},
        after={"name": "w1", "weight": 2.5, "api_key": "sk-secret"},
        what="w1",
        worker=worker,
        data={"extra": True},
    )
    assert event is not None
    assert event.message == "w1: weight 1.0 → 2.5, api_key not set → set"
    assert event.data == {
        "extra": True,
        "before": {"weight": 1.0, "api_key": "not set"},
        "after": {"weight": 2.5, "api_key": "set"},
    }
    assert "sk-secret" not in json.dumps(event.data) + event.message


def test_fields_only_one_side_has_count_as_changed() -> None:
    diff = events.changes_masked({"gone": 1}, {"new": [1, 2]})
    assert diff == ({"gone": 1, "new": None}, {"gone": None, "new": [1, 2]})
    assert events.changes_text(*diff) == "gone 1 → none, new none → [1, 2]"


def test_every_value_becomes_one_json_can_hold() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    value: Any = {
        "at": when, "day": date(2026, 1, 2), 3: (1, {2}), "n": None, "d": Decimal("1.5"),
    }  # fmt: skip
    plain = events.plain(value)
    assert plain == {
        "at": "2026-01-02T03:04:05+00:00", "day": "2026-01-02", "3": [1, [2]], "n": None,
        "d": "1.5",
    }  # fmt: skip
    assert json.loads(json.dumps(plain)) == plain
    assert events.masked({"password": "p", "secret": "", "at": when}) == {
        "password": "set", "secret": "not set", "at": "2026-01-02T03:04:05+00:00",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "none"), ("", '""'), ("plain", "plain"), ({"b": 1, "a": "é"}, '{"a": "é", "b": 1}')],
)
def test_values_read_as_people_read_them(value: Any, text: str) -> None:
    assert events.value_text(value) == text


def test_lines_name_api_keys_and_unknown_kinds_plainly() -> None:
    line = events.event_line(kind=EventKind.API_KEY_REVOKED, worker="", message="k", actor="")
    assert line == "API key revoked: k"
    assert (
        events.event_line(kind="custom", worker="w", message="m", actor="a") == "custom w: m (by a)"
    )


def test_a_change_outside_the_services_still_reaches_the_routers() -> None:
    before = RoutingGeneration.current()
    events.routing_changed()
    assert RoutingGeneration.current() != before
