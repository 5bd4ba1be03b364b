"""One way to write a time: date, seconds and the zone's name, in the deployment's zone,
from an aware or naive datetime (naive is UTC) or Unix seconds; the clock form for axes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from controlpanel.console.timefmt import clock_label, time_label, zone_name

MOMENT = datetime(2026, 12, 1, 9, 30, 12, tzinfo=UTC)


def test_every_form_of_a_moment_reads_the_same() -> None:
    naive = MOMENT.replace(tzinfo=None)
    other_zone = MOMENT.astimezone(timezone(timedelta(hours=5)))
    for value in (MOMENT, naive, other_zone, MOMENT.timestamp(), int(MOMENT.timestamp())):
        assert time_label(value) == "2026-12-01 09:30:12 UTC"
    assert clock_label(MOMENT.timestamp()) == "09:30"
    assert zone_name() == "UTC"


def test_the_deployments_zone_is_used_and_named(settings: pytest.FixtureRequest) -> None:
    settings.TIME_ZONE = "Europe/Berlin"  # type: ignore[attr-defined]
    assert time_label(MOMENT) == "2026-12-01 10:30:12 CET"
    assert clock_label(MOMENT) == "10:30"
    assert zone_name() in {"CET", "CEST"}
