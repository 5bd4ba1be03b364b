"""The GPUs on the operator's pages: the fleet row's strip and the worker page's charts.

The strip has one cell per GPU with a utilisation bar and a memory bar, and the rest
(model, temperature, power, errors) in the cell's tooltip. ``None`` instead of a strip means
no source reports fresh readings, which the page shows as "unknown". The charts draw each
GPU's utilisation, memory and temperature over the last 15 minutes from the probes'
history, on one fixed 0-100 scale (percent and °C), so two GPUs' charts compare at a glance.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from controlpanel.gpu import GpuReading
from controlpanel.gpu_health import fresh_gpus, memory_percent
from controlpanel.models import Worker, WorkerSample

GIB = 1024**3
CHART_WIDTH, CHART_HEIGHT = 560, 120
CHART_SERIES = ("util", "mem", "temp")


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


def gpu_charts(worker: Worker, minutes: int = 15) -> list[dict[str, Any]]:
    """One chart per GPU seen in the window: SVG points per series and the latest values."""
    since = timezone.now() - timedelta(minutes=minutes)
    history = list(
        WorkerSample.objects.filter(worker=worker, at__gte=since).values_list("gpus", flat=True)
    )
    series: dict[int, dict[str, list[float | None]]] = defaultdict(
        lambda: {name: [None] * len(history) for name in CHART_SERIES}
    )
    for position, points in enumerate(history):
        for point in points or ():
            for name in CHART_SERIES:
                series[point["index"]][name][position] = _scaled(name, point.get(name))
    return [_chart(index, series[index]) for index in sorted(series)]


def _scaled(name: str, value: Any) -> float | None:
    if not isinstance(value, int | float):
        return None
    # Fractions become percent; temperature stays in °C on the same 0-100 scale.
    return float(value) if name == "temp" else float(value) * 100


def _chart(index: int, values: dict[str, list[float | None]]) -> dict[str, Any]:
    return {
        "index": index,
        "points": {name: fixed_scale_points(values[name]) for name in CHART_SERIES},
        "latest": {name: _last_known(values[name]) for name in CHART_SERIES},
    }


def _last_known(values: list[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


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
