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

from controlpanel.console.gpu_dashboard import GpuCell, gpu_strip
from controlpanel.fleet.selectors import sole_models
from controlpanel.fleet.traffic_health import RATE_WINDOW_SECONDS
from controlpanel.registry.choices import WorkerRole
from controlpanel.registry.models import ROUTER_LIVENESS, RouterInstance, Worker, WorkerSample

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
    # The models nobody else can take now: draining or removing this worker asks first.
    sole_models: list[str] = field(default_factory=list)

    @property
    def severity(self) -> dict[str, str]:
        """Each cell's colour class: "bad", "warn" or "" (see cell_severity)."""
        return cell_severity(self)

    @property
    def worst(self) -> str:
        levels = set(self.severity.values())
        return "bad" if "bad" in levels else "warn" if "warn" in levels else "ok"

    @property
    def key(self) -> tuple[Any, ...]:
        """Changes whenever anything the row shows changes (ages are counted in the page)."""
        return (
            self.worker.updated_at,
            self.inflight,
            self.routable,
            self.sparkline,
            self.metrics.get("error_rate"),
            self.metrics.get("router_rps"),
            tuple(self.sole_models),
            self.gpus is None,  # readings turn stale with no write to the row
        )


@dataclass
class RouterView:
    """What the live routers say about each worker, summed over every router process:
    in flight now, and requests and failures over the windows of their reports
    (controlpanel.fleet.traffic_health), so a burst shows as a burst."""

    inflight: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    requests: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    rate_requests: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    live: bool = False  # any router reported: without one, rates are unknown, not zero

    def error_rate(self, worker_id: int) -> float | None:
        requests = self.requests.get(worker_id, 0)
        return self.errors.get(worker_id, 0) / requests if requests else None

    def rps(self, worker_id: int) -> float | None:
        if not self.live:
            return None
        return self.rate_requests.get(worker_id, 0) / RATE_WINDOW_SECONDS


def router_view() -> RouterView:
    view = RouterView()
    rows = RouterInstance.live(ROUTER_LIVENESS).values_list("inflight", "window")
    for inflight, window in rows:
        view.live = True
        for worker_id, count in inflight.items():
            view.inflight[int(worker_id)] += count
        for worker_id, counts in (window or {}).items():
            requests, errors, rate = [*counts, 0, 0, 0][:3]
            view.requests[int(worker_id)] += requests
            view.errors[int(worker_id)] += errors
            view.rate_requests[int(worker_id)] += rate
    return view


def fleet_rows(workers: QuerySet[Worker] | None = None) -> list[Row]:
    now = timezone.now()
    workers_list = list(workers if workers is not None else Worker.objects.all())
    routers = router_view()
    history = _recent_samples([w.pk for w in workers_list], now, SPARKLINE_MINUTES)
    rows = [_row(w, routers, history.get(w.pk, []), now) for w in workers_list]
    fleet = workers_list if workers is None else list(Worker.objects.all())
    for row in rows:
        row.sole_models = sole_models(row.worker, fleet, now)
    return rows


def _row(worker: Worker, routers: RouterView, samples: list[WorkerSample], now: datetime) -> Row:
    metrics = dict(worker.metrics or {})
    # The routers' view of failures over the degraded window: vLLM does not count requests
    # it never answered, the routers do. Their request rate is live, where vLLM's scraped
    # rps is a difference between two probes.
    metrics["error_rate"] = routers.error_rate(worker.pk)
    metrics["window_requests"] = routers.requests.get(worker.pk, 0)
    metrics["router_rps"] = routers.rps(worker.pk)
    return Row(
        worker=worker,
        inflight=routers.inflight.get(worker.pk, 0),
        routable=worker.is_routable(
            settings.CONTROLPANEL_HEARTBEAT_EXPIRY, now, settings.CONTROLPANEL_DEGRADED_WEIGHT
        ),
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
    roles: str = ""  # "2 prefill · 3 decode · 1 both" when disaggregated (role_counts)


def model_totals(rows: list[Row]) -> list[ModelTotals]:
    """Per base model: how many workers, how many take traffic, and their summed load."""
    totals: dict[str, ModelTotals] = {}
    serving: dict[str, list[Worker]] = {}
    for row in rows:
        for entry in row.worker.models:
            if entry.get("parent"):
                continue
            total = totals.setdefault(entry["id"], ModelTotals(entry["id"]))
            _add_row(total, row)
            total.loras.update(m["id"] for m in row.worker.models if m.get("parent"))
            serving.setdefault(entry["id"], []).append(row.worker)
    for total in totals.values():
        total.roles = role_counts(serving[total.name])
    return sorted(totals.values(), key=lambda t: t.name)


def role_counts(workers: list[Worker]) -> str:
    """A model's workers by their part in prefill/decode disaggregation, e.g. "2 prefill ·
    3 decode · 1 both"; "" when all are "both" (the model is not disaggregated)."""
    counts = {role: sum(w.role == role for w in workers) for role in WorkerRole.values}
    if not counts[WorkerRole.PREFILL] and not counts[WorkerRole.DECODE]:
        return ""
    return " · ".join(f"{n} {role}" for role, n in counts.items() if n)


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


# --- severity: what the fleet table colours and the problems banner lists ------------------

BAD_STATES = {"unhealthy", "offline", "degraded"}


def cell_severity(row: Row) -> dict[str, str]:
    m, w = row.metrics, row.worker
    error_rate = m.get("error_rate")
    waiting = m.get("waiting")
    kv = m.get("kv_cache_usage")
    warn_waiting = settings.CONTROLPANEL_WARN_WAITING
    bad_state = w.state in BAD_STATES or w.sleeping
    return {
        "state": "bad" if bad_state else "warn" if w.state == "draining" else "",
        "errors": _level(
            error_rate,
            settings.CONTROLPANEL_WARN_ERROR_RATE,
            settings.CONTROLPANEL_DEGRADED_ERROR_RATE,
        ),
        "waiting": _level(waiting, warn_waiting, 4 * warn_waiting),
        "kv": _level(kv, 0.9, 0.98),
        "gpus": "warn" if w.gpu_warnings else "",
    }


def _level(value: float | None, warn: float, bad: float) -> str:
    if value is None:
        return ""
    return "bad" if value >= bad else "warn" if value >= warn else ""
