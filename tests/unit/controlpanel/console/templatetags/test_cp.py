"""The pages' filters: a missing reading is "unknown", never zero; times in the one
format; severity classes, lookups, state and kind labels."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from controlpanel.console.templatetags import cp
from controlpanel.registry.choices import EventKind

UNKNOWN = '<span class="unknown" title="not reported">unknown</span>'


@pytest.mark.parametrize("missing", [None, ""])
def test_a_missing_reading_is_unknown_in_every_format(missing: object) -> None:
    for show in (cp.unknown, cp.percent, cp.millis, cp.decimal):
        assert str(show(missing)) == UNKNOWN


def test_a_zero_reading_is_shown_as_zero() -> None:
    assert cp.unknown(0) == 0
    assert (cp.percent(0), cp.millis(0.0), cp.decimal(0)) == ("0%", "0 ms", "0.0")
    assert (cp.percent("0.426"), cp.millis(0.0125), cp.decimal(3.14159, 3)) == (
        "43%",
        "12 ms",
        "3.142",
    )


def test_times_in_the_one_format_and_a_dash_for_nothing() -> None:
    moment = datetime(2026, 12, 1, 9, 30, 12, tzinfo=UTC)
    assert cp.epoch_time(moment.timestamp()) == "2026-12-01 09:30:12 UTC"
    assert cp.epoch_time("soon") == "" and cp.epoch_time(None) == ""
    expected = '<time datetime="2026-12-01T09:30:12+00:00">2026-12-01 09:30:12 UTC</time>'
    assert str(cp.when(moment)) == expected
    assert str(cp.when(moment.isoformat())) == expected
    assert str(cp.when(moment.timestamp())) == expected
    assert cp.when("not a time") == "not a time"
    assert cp.when("") == "—" and cp.when(None) == "—"


def test_lookups_classes_and_labels() -> None:
    assert cp.sev({"kv": "bad", "waiting": ""}, "kv") == "sev-bad"
    assert cp.sev({"kv": "bad", "waiting": ""}, "waiting") == ""
    assert cp.sev({}, "gpus") == ""
    assert cp.get({"a": 1}, "a") == 1 and cp.get({"a": 1}, "b") == "" and cp.get(None, "a") == ""
    assert cp.state_label("rolled_back") == "rolled back"
    assert cp.kind_label(EventKind.WORKER_JOINED) == "Worker joined"
    assert cp.kind_label("api_key_created") == "API key created"
    assert cp.kind_label("from_a_newer_release") == "from_a_newer_release"


def test_a_setting_is_shown_as_people_write_it(settings: pytest.FixtureRequest) -> None:
    settings.CONTROLPANEL_DEGRADED_WINDOW = 30.0  # type: ignore[attr-defined]
    settings.CONTROLPANEL_WARN_WAITING = 8  # type: ignore[attr-defined]
    assert cp.setting("CONTROLPANEL_DEGRADED_WINDOW") == "30"
    assert cp.setting("CONTROLPANEL_WARN_WAITING") == 8
