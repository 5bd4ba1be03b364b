"""Read queries over the fleet, shared by the API and the console."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.utils import timezone

from controlpanel.registry.models import ROUTER_LIVENESS, RouterInstance, Worker


def workers_by_model() -> dict[str, list[int]]:
    """Which workers serve each model name (base or LoRA), from one query."""
    serving: dict[str, list[int]] = {}
    for pk, entries in Worker.objects.values_list("pk", "models"):
        for entry in entries:
            serving.setdefault(entry["id"], []).append(pk)
    return serving


def routable_now(worker: Worker, now: datetime) -> bool:
    return worker.is_routable(
        settings.CONTROLPANEL_HEARTBEAT_EXPIRY, now, settings.CONTROLPANEL_DEGRADED_WEIGHT
    )


def sole_models(worker: Worker, others: list[Worker], now: datetime) -> list[str]:
    """The models (and LoRA adapters) no routable worker but this one serves: taking it
    out leaves their clients with 503s."""
    if not routable_now(worker, now):
        return []
    covered = {
        e["id"] for w in others if w.pk != worker.pk and routable_now(w, now) for e in w.models
    }
    return [e["id"] for e in worker.models if e["id"] not in covered]


def worker_sole_models(worker: Worker) -> list[str]:
    return sole_models(worker, list(Worker.objects.exclude(pk=worker.pk)), timezone.now())


def worker_inflight(worker_id: int) -> int:
    """Requests every live router has in flight on the worker now."""
    rows = RouterInstance.live(ROUTER_LIVENESS).values_list("inflight", flat=True)
    return sum(int(inflight.get(str(worker_id), 0)) for inflight in rows)
