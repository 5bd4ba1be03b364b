"""The GPUs on the pages: the fleet row's strip (unknown when no source reports fresh
readings), each cell's bars and tooltip, a warning marking the GPU it names, and one
chart per GPU on a fixed 0-100 scale."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from controlpanel.console import charts
from controlpanel.console.gpu_dashboard import GIB, fixed_scale_points, gpu_charts, gpu_strip
from controlpanel.registry.models import Worker

NOW = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


def reading(index: int, **values: Any) -> dict[str, Any]:
    base = {"index": index, "uuid": f"GPU-{index}abc", "name": None, "util": None,
            "mem_used": None, "mem_total": None, "temp": None, "power": None,
            "power_limit": None, "ecc_errors": None, "xid": None}  # fmt: skip
    return {**base, **values}


def worker(gpus: list[dict[str, Any]], *, age_s: float = 1, **fields: Any) -> Worker:
    return Worker(name="w", url="http://x", models=[], gpus=gpus, gpus_source="nvml",
                  gpus_at=NOW - timedelta(seconds=age_s), **fields)  # fmt: skip


def test_no_source_or_stale_readings_are_unknown_not_an_empty_strip() -> None:
    assert gpu_strip(Worker(name="w", url="http://x", models=[]), NOW) is None
    assert gpu_strip(worker([reading(0)], age_s=10**6), NOW) is None
    assert gpu_strip(worker([], age_s=1), NOW) == []


def test_a_cells_bars_and_tooltip() -> None:
    full = reading(0, name="H100", util=0.42, mem_used=20 * GIB, mem_total=80 * GIB, temp=61,
                   power=300.0, power_limit=700.0)  # fmt: skip
    (cell, bare) = gpu_strip(worker([full, reading(1)]), NOW) or []
    assert (cell.util, cell.mem, cell.mem_total_gib) == (pytest.approx(42), 25.0, 80.0)
    assert cell.title.splitlines() == [
        "GPU 0 · H100", "utilisation 42%", "memory 20.0 / 80.0 GiB", "temperature 61 °C",
        "power 300 W of 700 W",
    ]  # fmt: skip
    assert bare.title.splitlines()[1:] == [
        "utilisation unknown", "memory unknown", "temperature unknown", "power unknown",
    ]  # fmt: skip


def test_a_warning_marks_the_gpu_it_names_by_uuid_or_index() -> None:
    warnings = [{"key": "temp:GPU-1abc", "message": "hot"}, {"key": "xid:2", "message": "x"},
                {"key": "nokey", "message": "?"}]  # fmt: skip
    cells = gpu_strip(worker([reading(i) for i in range(4)], gpu_warnings=warnings), NOW) or []
    assert [c.warned for c in cells] == [False, True, True, False]


def test_one_chart_per_gpu_on_a_fixed_scale() -> None:
    window = charts.window_for("15m", NOW)
    at = NOW - timedelta(seconds=30)
    history = [
        (at, None, None, None, None, None, [{"index": 1, "util": 0.5, "mem": 0.25, "temp": 70},
                                            {"index": 0, "util": "n/a"}]),
        (at, None, None, None, None, None, None),
    ]  # fmt: skip
    first, second = gpu_charts(history, window)
    assert (first.title, second.title) == ("GPU 0", "GPU 1")
    assert first.top == second.top == 100.0 and first.empty
    assert [(css, last) for css, _, last, _ in second.legend] == [
        ("util", 50.0), ("mem", 25.0), ("temp", 70.0),
    ]  # fmt: skip
    assert second.testid == "gpu-chart"


def test_fixed_scale_points_clamp_and_skip_unknown() -> None:
    assert fixed_scale_points([None, 5.0]) == ""
    points = fixed_scale_points([0.0, None, 250.0], top=100.0, width=10, height=12)
    assert points == "0.0,11.0 10.0,1.0"
