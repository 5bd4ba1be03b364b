"""The workers' queue reports every router reads once a second (controlpanel.routers.
snapshot.load_reports, one plain query): what the ORM stored comes back to the microsecond,
on SQLite (text) and PostgreSQL (timestamptz) alike."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from controlpanel.registry.models import Worker
from controlpanel.routers.snapshot import load_reports

pytestmark = pytest.mark.django_db


def test_each_reported_queue_comes_back_with_when_it_was_read() -> None:
    read_at = datetime(2026, 12, 6, 5, 40, 1, 123456, tzinfo=UTC)
    busy = Worker.objects.create(
        url="http://busy:8000", name="busy", queue_length=7, queue_length_at=read_at
    )
    unknown = Worker.objects.create(
        url="http://unknown:8000", name="unknown", queue_length=None, queue_length_at=read_at
    )
    Worker.objects.create(url="http://never:8000", name="never")  # never reported: left out
    assert load_reports() == {
        busy.pk: (7, read_at.timestamp()),
        unknown.pk: (0, read_at.timestamp()),
    }


def test_no_reports_read_as_none() -> None:
    Worker.objects.create(url="http://never:8000", name="never")
    assert load_reports() == {}
