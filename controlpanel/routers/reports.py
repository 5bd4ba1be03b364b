"""What routers report back: liveness, requests in flight, failures and ejections."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.utils import timezone

from controlpanel.fleet import health, traffic_health
from controlpanel.fleet.services import workers_finish_drains
from controlpanel.registry.choices import EventKind
from controlpanel.registry.events import event_record
from controlpanel.registry.models import ROUTER_LIVENESS, RouterInstance, Worker
from routing.fleet.priority import PRIORITIES
from routing.ports import RouterReport

CLASS_COUNTS = ("queued", "admitted", "shed")


def router_report(*, report: RouterReport) -> bool:
    """A router says it is alive, what it has in flight (drains may then finish), what
    failed on real traffic and whom it ejected.

    Returns whether this router is the one that exports the fleet's worker gauges on its
    /metrics (the longest-running live router), so several replicas never double-count."""
    router_ejections(report.ejections)
    for worker_id, (count, cause) in report.failures.items():
        health.worker_passive_failures(worker_id=worker_id, failures=count, cause=cause)
    window = traffic_health.router_window(instance_id=report.instance_id, totals=report.totals)
    RouterInstance.objects.update_or_create(
        instance_id=report.instance_id,
        defaults={
            "hostname": report.hostname,
            "pid": report.pid,
            "started_at": datetime.fromtimestamp(report.started_at, tz=UTC),
            "last_seen": timezone.now(),
            "inflight": {str(k): v for k, v in report.inflight.items() if v},
            "generation": report.generation,
            "recent": {str(k): list(v) for k, v in report.recent.items() if v[0]},
            "traffic": report.traffic,
            "window": window,
            "kv_events": {str(k): v for k, v in report.kv_events.items()},
            "classes": report.classes,
            "fallbacks": [list(row) for row in report.fallbacks],
        },
    )
    traffic_health.workers_judge_traffic()
    RouterInstance.objects.filter(last_seen__lt=timezone.now() - ROUTER_LIVENESS * 20).delete()
    workers_finish_drains()
    oldest = (
        RouterInstance.live(ROUTER_LIVENESS)
        .order_by("started_at", "instance_id")
        .values_list("instance_id", flat=True)
        .first()
    )
    return oldest == report.instance_id


def router_ejections(ejections: list[tuple[int, str, str]]) -> None:
    """A router took a failing worker out of its rotation, or put it back after a probe."""
    kinds = {"ejected": EventKind.WORKER_EJECTED, "readmitted": EventKind.WORKER_READMITTED}
    workers = Worker.objects.in_bulk([worker_id for worker_id, _, _ in ejections])
    for worker_id, kind, message in ejections:
        worker = workers.get(worker_id)
        if worker is not None and kind in kinds:
            event_record(kind=kinds[kind], worker=worker, message=message, actor="router")


def router_forget(*, instance_id: str) -> None:
    RouterInstance.objects.filter(instance_id=instance_id).delete()
    traffic_health.router_history_forget(instance_id=instance_id)


def worker_kv_streams(*, worker_id: int) -> list[dict[str, Any]]:
    """How every live router sees the worker's KV events stream (empty: none subscribes)."""
    key, rows = str(worker_id), []
    for router in RouterInstance.live(ROUTER_LIVENESS).order_by("started_at", "instance_id"):
        stream = (router.kv_events or {}).get(key)
        if stream is not None:
            rows.append({"router": f"{router.hostname}:{router.pid}", **stream})
    return rows


def model_classes() -> dict[str, list[dict[str, Any]]]:
    """Per model, summed over the live routers: each priority class's requests waiting now,
    admitted and shed since those routers started (routing.admission.admission.class_counts)."""
    totals: dict[str, dict[str, list[int]]] = {}
    for report in RouterInstance.live(ROUTER_LIVENESS).values_list("classes", flat=True):
        for model, counts in (report or {}).items():
            into = totals.setdefault(model, {k: [0] * len(PRIORITIES) for k in CLASS_COUNTS})
            for kind in CLASS_COUNTS:
                for rank, count in enumerate(counts.get(kind, [])[: len(PRIORITIES)]):
                    into[kind][rank] += int(count)
    return {
        model: [
            {"name": name, **{kind: counts[kind][rank] for kind in CLASS_COUNTS}}
            for rank, name in enumerate(PRIORITIES)
        ]
        for model, counts in totals.items()
    }


def fallback_counts() -> dict[str, dict[str, int]]:
    """Per model or alias: the requests that moved on from it to each fallback, summed over
    the live routers since each started."""
    totals: dict[str, dict[str, int]] = {}
    for rows in RouterInstance.live(ROUTER_LIVENESS).values_list("fallbacks", flat=True):
        for origin, target, _reason, count in rows or []:
            into = totals.setdefault(str(origin), {})
            into[str(target)] = into.get(str(target), 0) + int(count)
    return totals
