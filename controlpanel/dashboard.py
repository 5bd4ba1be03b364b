"""What the operator's pages show, read from the registry: fleet rows, per-model totals,
charts. Shared by the first render (views) and the live feed (live.py), so both always
say the same thing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.template.loader import render_to_string
from django.utils import timezone

from controlpanel.gpu_dashboard import GpuCell, gpu_strip
from controlpanel.models import RouterInstance, Worker, WorkerSample
from controlpanel.services import ROUTER_LIVENESS

SPARKLINE_MINUTES = 15
CHART_WIDTH, CHART_HEIGHT = 120, 24


@dataclass
class Row:
    """One worker as the fleet table shows it; `None` always means "unknown"."""

    worker: Worker
    inflight: int
    routable: bool
    heartbeat_at: float | None
    probe_at: float | None
    sparkline: str  # SVG polyline points of running + waiting over the last 15 minutes
    metrics: dict[str, Any] = field(default_factory=dict)
    gpus: list[GpuCell] | None = None  # None: no GPU source reports fresh readings

    @property
    def key(self) -> tuple[Any, ...]:
        """Changes whenever anything the row shows changes (ages are counted in the page)."""
        return (
            self.worker.updated_at,
            self.inflight,
            self.routable,
            self.sparkline,
            self.metrics.get("error_rate"),
            self.gpus is None,  # readings turn stale with no write to the row
        )


@dataclass
class RouterView:
    """What the live routers say about each worker, summed over every router process."""

    inflight: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    requests: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def error_rate(self, worker_id: int) -> float | None:
        requests = self.requests.get(worker_id, 0)
        return self.errors.get(worker_id, 0) / requests if requests else None


def router_view() -> RouterView:
    view = RouterView()
    rows = RouterInstance.live(ROUTER_LIVENESS).values_list("inflight", "recent")
    for inflight, recent in rows:
        for worker_id, count in inflight.items():
            view.inflight[int(worker_id)] += count
        for worker_id, (requests, errors) in recent.items():
            view.requests[int(worker_id)] += requests
            view.errors[int(worker_id)] += errors
    return view


def fleet_rows(workers: QuerySet[Worker] | None = None) -> list[Row]:
    now = timezone.now()
    workers_list = list(workers if workers is not None else Worker.objects.all())
    routers = router_view()
    history = _recent_samples([w.pk for w in workers_list], now, SPARKLINE_MINUTES)
    return [_row(w, routers, history.get(w.pk, []), now) for w in workers_list]


def _row(worker: Worker, routers: RouterView, samples: list[WorkerSample], now: datetime) -> Row:
    metrics = dict(worker.metrics or {})
    # The router's view of failures over the last minute: vLLM does not count requests it
    # never answered, the router does.
    metrics["error_rate"] = routers.error_rate(worker.pk)
    return Row(
        worker=worker,
        inflight=routers.inflight.get(worker.pk, 0),
        routable=worker.is_routable(settings.CONTROLPANEL_HEARTBEAT_EXPIRY, now),
        heartbeat_at=worker.last_heartbeat.timestamp() if worker.last_heartbeat else None,
        probe_at=worker.last_probe_at.timestamp() if worker.last_probe_at else None,
        sparkline=sparkline_points([_load(s) for s in samples]),
        metrics=metrics,
        gpus=gpu_strip(worker, now),
    )


def _load(sample: WorkerSample) -> float | None:
    if sample.running is None and sample.waiting is None:
        return None
    return float((sample.running or 0) + (sample.waiting or 0))


def _recent_samples(
    worker_ids: list[int], now: datetime, minutes: int
) -> dict[int, list[WorkerSample]]:
    by_worker: dict[int, list[WorkerSample]] = defaultdict(list)
    since = now - timedelta(minutes=minutes)
    for sample in WorkerSample.objects.filter(worker_id__in=worker_ids, at__gte=since):
        by_worker[sample.worker_id].append(sample)
    return by_worker


def sparkline_points(
    values: list[float | None], width: int = CHART_WIDTH, height: int = CHART_HEIGHT
) -> str:
    """SVG polyline points; unknown readings are skipped rather than drawn as zero."""
    known = [(i, v) for i, v in enumerate(values) if v is not None]
    if len(known) < 2:
        return ""
    top = max(v for _, v in known) or 1.0
    span = max(len(values) - 1, 1)
    return " ".join(
        f"{i * width / span:.1f},{height - 1 - v / top * (height - 2):.1f}" for i, v in known
    )


@dataclass
class ModelTotals:
    name: str
    workers: int = 0
    routable: int = 0
    inflight: int = 0
    running: int | None = None
    waiting: int | None = None
    rps: float | None = None
    loras: set[str] = field(default_factory=set)


def model_totals(rows: list[Row]) -> list[ModelTotals]:
    """Per base model: how many workers, how many take traffic, and their summed load."""
    totals: dict[str, ModelTotals] = {}
    for row in rows:
        for entry in row.worker.models:
            if entry.get("parent"):
                continue
            total = totals.setdefault(entry["id"], ModelTotals(entry["id"]))
            _add_row(total, row)
            total.loras.update(m["id"] for m in row.worker.models if m.get("parent"))
    return sorted(totals.values(), key=lambda t: t.name)


def _add_row(total: ModelTotals, row: Row) -> None:
    total.workers += 1
    total.routable += int(row.routable)
    total.inflight += row.inflight
    for name in ("running", "waiting", "rps"):
        value = row.metrics.get(name)
        if value is not None:
            setattr(total, name, (getattr(total, name) or 0) + value)


def render_row(row: Row) -> str:
    return render_to_string("controlpanel/_worker_row.html", {"row": row})


def render_totals(rows: list[Row]) -> str:
    return render_to_string("controlpanel/_model_totals.html", {"totals": model_totals(rows)})


def chart_series(worker: Worker, minutes: int = SPARKLINE_MINUTES) -> dict[str, dict[str, Any]]:
    """The worker page's charts: SVG points and the top of the scale, per signal."""
    samples = _recent_samples([worker.pk], timezone.now(), minutes).get(worker.pk, [])
    series = {
        "queue": [_load(s) for s in samples],
        "kv_cache": [None if s.kv_cache_usage is None else s.kv_cache_usage * 100 for s in samples],
        "ttft": [None if s.ttft_p50 is None else s.ttft_p50 * 1000 for s in samples],
        "rps": [s.rps for s in samples],
    }
    return {
        name: {
            "points": sparkline_points(values, 560, 120),
            "top": max((v for v in values if v is not None), default=None),
        }
        for name, values in series.items()
    }
