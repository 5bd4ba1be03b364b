"""The worker page's charts: probe history over 15 minutes, 1 hour or 6 hours, drawn on the
server as SVG with axes and time labels, and a little data for the page's hover readout
(static/controlpanel/charts.js).

Why buckets: 6 hours of 5-second probes is 4,320 samples a series, more points than a chart
has pixels. Every range is cut into BUCKETS equal slots and a slot shows the mean of the
readings that fell in it, so the 15-minute range (5-second slots) still shows each probe
and the longer ones show a steady line. A slot with no reading is unknown, not zero: the
line bridges a short gap (a late probe) and breaks on a longer one (the worker was away).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import orjson
from django.conf import settings
from django.utils import timezone

from controlpanel.console.timefmt import clock_label, time_label, zone_name
from controlpanel.registry.models import Worker, WorkerSample

# key: (minutes, label, seconds between time ticks)
RANGES: dict[str, tuple[int, str, int]] = {
    "15m": (15, "15 minutes", 180),
    "1h": (60, "1 hour", 600),
    "6h": (360, "6 hours", 3600),
}
RANGE_LINKS = {"15m": "15 min", "1h": "1 h", "6h": "6 h"}
DEFAULT_RANGE = "15m"
BUCKETS = 180
BRIDGE_BUCKETS = 3  # a line bridges up to this many empty slots, and breaks beyond
# The SVG's own coordinates; the page scales it to its box, keeping the aspect ratio.
WIDTH, HEIGHT = 520, 180
LEFT, RIGHT, TOP, BOTTOM = 40, 10, 10, 22


@dataclass(frozen=True)
class Window:
    key: str
    label: str
    start: float  # Unix seconds
    end: float
    tick_seconds: int

    @property
    def bucket_seconds(self) -> float:
        return (self.end - self.start) / BUCKETS

    def slot(self, at: float) -> int | None:
        index = int((at - self.start) / self.bucket_seconds)
        return index if 0 <= index < BUCKETS else None

    def x(self, at: float) -> float:
        return LEFT + (at - self.start) / (self.end - self.start) * (WIDTH - LEFT - RIGHT)


def window_for(key: str | None, now: datetime | None = None) -> Window:
    """The range asked for (`?range=`), the default one for anything else."""
    key = key if key in RANGES else DEFAULT_RANGE
    minutes, label, tick = RANGES[key]
    end = (now or timezone.now()).timestamp()
    return Window(key, label, end - minutes * 60, end, tick)


def history_short_of(window: Window) -> int | None:
    """The minutes of history kept when that is less than the window shows, else None."""
    kept: int = settings.CONTROLPANEL_HISTORY_MINUTES
    return kept if kept * 60 < window.end - window.start else None


@dataclass
class Line:
    css: str  # the polyline's class: its colour
    label: str  # what the hover readout calls it
    slots: list[float | None]
    unit: str = ""  # when the chart's lines differ (a GPU's % and °C)


@dataclass
class Chart:
    title: str
    unit: str
    lines: list[Line]
    window: Window
    top: float  # the top of the y axis
    testid: str = "chart"
    caption: str = ""
    polylines: list[tuple[str, str]] = field(default_factory=list)  # (css, points)
    y_ticks: list[tuple[str, str]] = field(default_factory=list)  # (y, label)
    x_ticks: list[tuple[str, str]] = field(default_factory=list)  # (x, label)
    data: str = ""  # JSON for the hover readout
    frame: ClassVar[dict[str, int]] = {
        "left": LEFT, "right": WIDTH - RIGHT, "top": TOP, "bottom": HEIGHT - BOTTOM,
        "width": WIDTH, "height": HEIGHT,
    }  # fmt: skip

    @property
    def empty(self) -> bool:
        return not self.polylines

    @property
    def legend(self) -> list[tuple[str, str, float | None, str]]:
        """Each line's colour, name, latest reading and unit, for a chart of several lines."""
        return [(ln.css, ln.label, _last_known(ln.slots), ln.unit) for ln in self.lines]


def slotted(window: Window, readings: Sequence[tuple[float, float | None]]) -> list[float | None]:
    """Readings (Unix seconds, value) as BUCKETS slot means; None where nothing was read."""
    sums, counts = [0.0] * BUCKETS, [0] * BUCKETS
    for at, value in readings:
        slot = window.slot(at)
        if slot is not None and value is not None:
            sums[slot] += value
            counts[slot] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def chart_build(
    *, title: str, unit: str, lines: list[Line], window: Window, top: float | None = None
) -> Chart:
    """Lay one chart out: a y axis from 0 to a round top (or the given one), time ticks on
    round minutes or hours, and one polyline per unbroken run of each line."""
    highest = max((v for line in lines for v in line.slots if v is not None), default=0.0)
    chart = Chart(title, unit, lines, window, top if top is not None else nice_top(highest))
    for line in lines:
        chart.polylines += [(line.css, pts) for pts in _runs(window, line.slots, chart.top)]
    fractions = (0, 0.25, 0.5, 0.75, 1)
    chart.y_ticks = [
        (f"{_y(chart.top * f, chart.top):.1f}", _number(chart.top * f)) for f in fractions
    ]
    chart.x_ticks = _time_ticks(window)
    chart.data = _hover_data(chart)
    return chart


def nice_top(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above value (1 for none)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power * 1.000001:
            return step * power
    return 10 * power


def _y(value: float, top: float) -> float:
    share = min(max(value / top, 0.0), 1.0) if top else 0.0
    return HEIGHT - BOTTOM - share * (HEIGHT - TOP - BOTTOM)


def _slot_x(window: Window, index: int) -> float:
    return window.x(window.start + (index + 0.5) * window.bucket_seconds)


def _runs(window: Window, slots: list[float | None], top: float) -> list[str]:
    """SVG points of each run of known slots, bridging gaps up to BRIDGE_BUCKETS long."""
    runs: list[list[str]] = []
    last = -BRIDGE_BUCKETS - 2
    for index, value in enumerate(slots):
        if value is None:
            continue
        if index - last > BRIDGE_BUCKETS + 1:
            runs.append([])
        runs[-1].append(f"{_slot_x(window, index):.1f},{_y(value, top):.1f}")
        last = index
    # A lone reading still shows, as a short flat stroke across its own slot.
    return [" ".join(r) if len(r) > 1 else _dot(r[0], window) for r in runs]


def _dot(point: str, window: Window) -> str:
    x, y = (float(p) for p in point.split(","))
    half = max(1.5, window.x(window.start + window.bucket_seconds / 2) - LEFT)
    return f"{x - half:.1f},{y:.1f} {x + half:.1f},{y:.1f}"


def _time_ticks(window: Window) -> list[tuple[str, str]]:
    step = window.tick_seconds
    first = math.ceil(window.start / step) * step
    return [
        (f"{window.x(at):.1f}", clock_label(datetime.fromtimestamp(at, tz=UTC)))
        for at in range(int(first), int(window.end) + 1, step)
    ]


def _hover_data(chart: Chart) -> str:
    window = chart.window
    times = [window.start + (i + 0.5) * window.bucket_seconds for i in range(BUCKETS)]
    return orjson.dumps(
        {
            "x0": LEFT,
            "x1": WIDTH - RIGHT,
            "width": WIDTH,
            "unit": chart.unit,
            "times": [time_label(datetime.fromtimestamp(t, tz=UTC)) for t in times],
            "xs": [round(_slot_x(window, i), 1) for i in range(BUCKETS)],
            "lines": [
                {
                    "css": line.css,
                    "label": line.label,
                    "unit": line.unit or chart.unit,
                    "values": [None if v is None else _round(v) for v in line.slots],
                    "ys": [None if v is None else round(_y(v, chart.top), 1) for v in line.slots],
                }
                for line in chart.lines
            ],
        }
    ).decode()


def _round(value: float) -> float:
    return round(value, 3 if abs(value) < 10 else 1)


def _number(value: float) -> str:
    return f"{value:g}" if value < 10_000 else f"{value / 1000:g}k"


def _last_known(values: list[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def window_context(window: Window) -> dict[str, Any]:
    """What the page says about the range: the links to the others and history's limit."""
    return {
        "range": window.key,
        "range_label": window.label,
        "ranges": list(RANGE_LINKS.items()),
        "history_minutes": history_short_of(window),
        "zone": zone_name(),
    }


# --- the worker page's four charts ---------------------------------------------------------


def worker_history(worker: Worker, window: Window) -> list[tuple[Any, ...]]:
    """The window's probe history, oldest first: (at, running, waiting, kv, ttft, rps, gpus)."""
    since = datetime.fromtimestamp(window.start, tz=UTC) - timedelta(seconds=1)
    return list(
        WorkerSample.objects.filter(worker=worker, at__gte=since).values_list(
            "at", "running", "waiting", "kv_cache_usage", "ttft_p50", "rps", "gpus"
        )
    )


def worker_charts(history: list[tuple[Any, ...]], window: Window) -> list[Chart]:
    def line(css: str, label: str, pick: Any) -> Line:
        return Line(css, label, slotted(window, [(r[0].timestamp(), pick(r)) for r in history]))

    def queue(r: tuple[Any, ...]) -> float | None:
        return None if r[1] is None and r[2] is None else float((r[1] or 0) + (r[2] or 0))

    def scaled(index: int, factor: float) -> Any:
        return lambda r: None if r[index] is None else r[index] * factor

    specs = [
        ("Queue (running + waiting)", "requests", line("queue", "queue", queue), None),
        ("KV-cache usage", "%", line("kv", "KV cache", scaled(3, 100)), 100.0),
        ("Time to first token p50", "ms", line("ttft", "TTFT p50", scaled(4, 1000)), None),
        ("Request rate", "req/s", line("rps", "requests", scaled(5, 1)), None),
    ]
    return [
        chart_build(title=title, unit=unit, lines=[ln], window=window, top=top)
        for title, unit, ln, top in specs
    ]
