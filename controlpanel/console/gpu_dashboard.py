"""The GPUs on the operator's pages: the fleet row's strip and the worker page's charts.

The strip has one cell per GPU with a utilisation bar and a memory bar, and the rest
(model, temperature, power, errors) in the cell's tooltip. ``None`` instead of a strip means
no source reports fresh readings, which the page shows as "unknown". The charts draw each
GPU's utilisation, memory and temperature over the page's range from the probes' history
(drawn by console.charts), on one fixed 0-100 scale (percent and °C), so two GPUs' charts
compare at a glance.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlpanel.console import charts
from controlpanel.fleet.gpu import GpuReading
from controlpanel.fleet.gpu_health import fresh_gpus, memory_percent
from controlpanel.registry.models import Worker

GIB = 1024**3
CHART_WIDTH, CHART_HEIGHT = 560, 120
CHART_SERIES = ("util", "mem", "temp")
CHART_LABELS = ("utilisation", "memory", "temperature")
CHART_UNITS = ("%", "%", "°C")


@dataclass(frozen=True)
class GpuCell:
    index: int
    name: str | None
    util: float | None  # percent
    mem: float | None  # percent
    mem_used_gib: float | None
    mem_total_gib: float | None
    temp: float | None
    power: float | None
    power_limit: float | None
    warned: bool  # a warning in force names this GPU

    @property
    def title(self) -> str:
        """The tooltip: everything the bars do not show."""
        parts = [f"GPU {self.index}" + (f" · {self.name}" if self.name else "")]
        parts.append(f"utilisation {_or_unknown(self.util, '{:.0f}%')}")
        if self.mem_used_gib is not None and self.mem_total_gib is not None:
            parts.append(f"memory {self.mem_used_gib:.1f} / {self.mem_total_gib:.1f} GiB")
        else:
            parts.append("memory unknown")
        parts.append(f"temperature {_or_unknown(self.temp, '{:.0f} °C')}")
        power = _or_unknown(self.power, "{:.0f} W")
        if self.power is not None and self.power_limit:
            power += f" of {self.power_limit:.0f} W"
        parts.append(f"power {power}")
        return "\n".join(parts)


def _or_unknown(value: float | None, form: str) -> str:
    return "unknown" if value is None else form.format(value)


def gpu_strip(worker: Worker, now: datetime) -> list[GpuCell] | None:
    readings = fresh_gpus(worker, now)
    if readings is None:
        return None
    warned = _warned_gpus(worker, readings)
    return [_cell(g, g["index"] in warned) for g in readings]


def _cell(gpu: GpuReading, warned: bool) -> GpuCell:
    used, total = gpu["mem_used"], gpu["mem_total"]
    return GpuCell(
        index=gpu["index"],
        name=gpu["name"],
        util=None if gpu["util"] is None else gpu["util"] * 100,
        mem=memory_percent(gpu),
        mem_used_gib=None if used is None else used / GIB,
        mem_total_gib=None if total is None else total / GIB,
        temp=gpu["temp"],
        power=gpu["power"],
        power_limit=gpu["power_limit"],
        warned=warned,
    )


def _warned_gpus(worker: Worker, readings: list[GpuReading]) -> set[int]:
    """GPU indexes that a warning in force names (its key carries the UUID or index)."""
    idents = {g["index"]: {g["uuid"], str(g["index"])} for g in readings}
    named = {w["key"].split(":")[1] for w in worker.gpu_warnings if w["key"].count(":") >= 1}
    return {index for index, ids in idents.items() if ids & named}


def gpu_charts(history: list[tuple[Any, ...]], window: charts.Window) -> list[charts.Chart]:
    """One chart per GPU seen in the window (history as charts.worker_history reads it):
    utilisation, memory and temperature on one fixed 0-100 scale."""
    readings: dict[int, dict[str, list[tuple[float, float | None]]]] = defaultdict(
        lambda: {name: [] for name in CHART_SERIES}
    )
    for row in history:
        at, points = row[0].timestamp(), row[-1]
        for point in points or ():
            for name in CHART_SERIES:
                readings[point["index"]][name].append((at, _scaled(name, point.get(name))))
    return [_chart(index, readings[index], window) for index in sorted(readings)]


def _scaled(name: str, value: Any) -> float | None:
    if not isinstance(value, int | float):
        return None
    # Fractions become percent; temperature stays in °C on the same 0-100 scale.
    return float(value) if name == "temp" else float(value) * 100


def _chart(
    index: int, readings: dict[str, list[tuple[float, float | None]]], window: charts.Window
) -> charts.Chart:
    lines = [
        charts.Line(name, label, charts.slotted(window, readings[name]), unit)
        for name, label, unit in zip(CHART_SERIES, CHART_LABELS, CHART_UNITS, strict=True)
    ]
    chart = charts.chart_build(title=f"GPU {index}", unit="", lines=lines, window=window, top=100.0)
    chart.testid = "gpu-chart"
    return chart


def fixed_scale_points(
    values: list[float | None],
    top: float = 100.0,
    width: int = CHART_WIDTH,
    height: int = CHART_HEIGHT,
) -> str:
    """SVG polyline points on a 0..top scale; unknown readings are skipped, never zero."""
    known = [(i, min(max(v, 0.0), top)) for i, v in enumerate(values) if v is not None]
    if len(known) < 2:
        return ""
    span = max(len(values) - 1, 1)
    return " ".join(
        f"{i * width / span:.1f},{height - 1 - v / top * (height - 2):.1f}" for i, v in known
    )
