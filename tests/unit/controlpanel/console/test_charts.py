"""The worker page's charts: a range cut into BUCKETS slots of means, a missing reading
unknown rather than zero (a short gap bridged, a long one breaking the line, a lone
reading still drawn), a round top for the y axis, time ticks on round minutes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from controlpanel.console import charts
from controlpanel.console.charts import BRIDGE_BUCKETS, BUCKETS, Line, chart_build

NOW = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


def window() -> charts.Window:
    return charts.window_for("15m", NOW)


def test_a_range_is_the_one_asked_for_or_the_default() -> None:
    assert charts.window_for("6h", NOW).end - charts.window_for("6h", NOW).start == 6 * 3600
    for key in (None, "", "2y"):
        assert charts.window_for(key, NOW).key == charts.DEFAULT_RANGE
    assert window().bucket_seconds == 15 * 60 / BUCKETS


@pytest.mark.parametrize(
    ("value", "top"),
    [(0, 1.0), (-3, 1.0), (0.7, 1.0), (1.2, 2.0), (2.2, 2.5), (3, 5.0), (7, 10.0), (100, 100.0),
     (101, 200.0), (0.03, 0.05)],
)  # fmt: skip
def test_the_y_axis_tops_at_a_round_number(value: float, top: float) -> None:
    assert charts.nice_top(value) == pytest.approx(top)


def test_readings_become_slot_means_and_unknown_stays_unknown() -> None:
    w = window()
    start = w.start
    readings = [(start + 1, 2.0), (start + 2, 4.0), (start + 10, None), (start - 5, 99.0)]
    slots = charts.slotted(w, readings)
    assert len(slots) == BUCKETS
    assert slots[0] == 3.0  # the mean of the first slot's two readings
    assert slots[1] is None  # only an unknown reading: unknown, not 0
    assert all(v is None for v in slots[2:])


def test_a_short_gap_is_bridged_and_a_long_one_breaks_the_line() -> None:
    slots: list[float | None] = [None] * BUCKETS
    for index in (0, 1, 2 + BRIDGE_BUCKETS, 50, 51, 120):
        slots[index] = 1.0
    chart = chart_build(title="t", unit="req", lines=[Line("q", "queue", slots)], window=window())
    assert [css for css, _ in chart.polylines] == ["q", "q", "q"]
    first, second, lone = (points.split() for _, points in chart.polylines)
    assert (len(first), len(second)) == (3, 2)
    assert len(lone) == 2 and lone[0].split(",")[1] == lone[1].split(",")[1]  # a flat stroke
    assert not chart.empty and chart.top == 1.0


def test_an_all_unknown_chart_is_empty_with_axes_and_hover_data() -> None:
    chart = chart_build(title="t", unit="ms", lines=[Line("q", "x", [None] * BUCKETS)],
                        window=window())  # fmt: skip
    assert chart.empty and chart.legend == [("q", "x", None, "")]
    assert [label for _, label in chart.y_ticks] == ["0", "0.25", "0.5", "0.75", "1"]
    ticks = [label for _, label in chart.x_ticks]
    assert ticks[0] == "09:15" and ticks[-1] == "09:30" and len(ticks) == 6
    data = json.loads(chart.data)
    assert data["unit"] == "ms" and len(data["times"]) == BUCKETS
    assert data["lines"][0]["values"] == [None] * BUCKETS


def test_the_worker_charts_scale_and_combine_their_readings() -> None:
    at = NOW - timedelta(seconds=2)
    history = [(at, 3, None, 0.5, 0.25, 1.5, None), (at, None, None, None, None, None, None)]
    queue, kv, ttft, rps = charts.worker_charts(history, window())
    assert queue.legend[0][2] == 3.0  # running + waiting, the unknown waiting not counted
    assert kv.top == 100.0 and kv.legend[0][2] == 50.0
    assert ttft.legend[0][2] == 250.0 and ttft.unit == "ms"
    assert rps.legend[0][2] == 1.5


def test_history_shorter_than_the_range_is_said(settings: pytest.FixtureRequest) -> None:
    settings.CONTROLPANEL_HISTORY_MINUTES = 60  # type: ignore[attr-defined]
    assert charts.history_short_of(charts.window_for("6h", NOW)) == 60
    assert charts.history_short_of(charts.window_for("1h", NOW)) is None
    context = charts.window_context(charts.window_for("6h", NOW))
    assert (context["range"], context["history_minutes"], context["zone"]) == ("6h", 60, "UTC")
