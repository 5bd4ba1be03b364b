"""Health from real traffic, as outlier detection does (Envoy's failure-percentage ejection).

Probes ask `/health`, which a worker answering 500 to most requests still passes. The routers
see what clients get, so every router report (about once a second under traffic) carries its
running totals per worker, requests and failures (5xx, refused, reset), since it started. This
module windows them, per router, in the process that receives the router's reports (the
router's own process: its refresher calls the control plane in-process), and stores each
router's windowed counts on its RouterInstance row. Summed over every live router:

* **Degraded.** An `active` worker with at least CONTROLPANEL_DEGRADED_MIN_REQUESTS requests
  over the last CONTROLPANEL_DEGRADED_WINDOW seconds, of which at least
  CONTROLPANEL_DEGRADED_ERROR_RATE failed, becomes `degraded`: it leaves the rotation (or,
  with CONTROLPANEL_DEGRADED_WEIGHT > 0, stays with that fraction of its weight), with the
  cause in `degraded_reason` and a `worker_degraded` event. /metrics shows it through
  `controlpanel_worker_state{state="degraded"}`.
* **Recovered.** A degraded worker returns to `active` once its window no longer condemns it
  (its failures aged out, or traffic at the reduced weight succeeds) and its last probe
  succeeded. Out of the rotation it gets no traffic, so it sits out about one window, as an
  outlier-detection ejection does; a worker that still fails is degraded again.

Every change is a conditional UPDATE on the state read, so several routers' reports judging
the same worker at once make one transition and one event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlpanel.registry.choices import EventKind, WorkerState
from controlpanel.registry.events import event_record
from controlpanel.registry.models import ROUTER_LIVENESS, RouterInstance, RoutingGeneration, Worker

log = logging.getLogger(__name__)

TRAFFIC_ACTOR = "traffic"
# The live request rate (REQ/S on the fleet page): short, so a burst shows as a burst.
RATE_WINDOW_SECONDS = 10.0

Totals = dict[int, tuple[int, int]]
_history: dict[str, deque[tuple[float, Totals]]] = defaultdict(deque)
_history_lock = threading.Lock()


def router_window(
    *, instance_id: str, totals: Totals, now: float | None = None
) -> dict[str, list[int]]:
    """One router's requests and errors per worker over the degraded window, and its
    requests over the rate window, from its running totals: {id: [requests, errors, rate]}."""
    now = time.time() if now is None else now
    keep = max(settings.CONTROLPANEL_DEGRADED_WINDOW, RATE_WINDOW_SECONDS)
    with _history_lock:
        history = _history[instance_id]
        history.append((now, dict(totals)))
        while len(history) > 1 and now - history[1][0] >= keep:
            history.popleft()
        window = _since(history, now - settings.CONTROLPANEL_DEGRADED_WINDOW)
        rate = _since(history, now - RATE_WINDOW_SECONDS)
    result: dict[str, list[int]] = {}
    for worker_id, (requests, errors) in totals.items():
        before = window.get(worker_id, (0, 0))
        recent = requests - rate.get(worker_id, (0, 0))[0]
        if requests - before[0] or recent:
            result[str(worker_id)] = [requests - before[0], errors - before[1], recent]
    return result


def _since(history: deque[tuple[float, Totals]], start: float) -> Totals:
    """The totals at a window's start: the newest kept at or before it. None older means
    the router is younger than the window, and its history starts at its first report, so
    it counts from zero."""
    baseline: Totals = {}
    for at, totals in history:
        if at > start:
            break
        baseline = totals
    return baseline


def fleet_window() -> dict[int, tuple[int, int, int]]:
    """Every live router's windows, summed per worker: (requests, errors, rate requests)."""
    summed: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for window in RouterInstance.live(ROUTER_LIVENESS).values_list("window", flat=True):
        for worker_id, counts in (window or {}).items():
            for i, value in enumerate(counts[:3]):
                summed[int(worker_id)][i] += value
    return {worker_id: (c[0], c[1], c[2]) for worker_id, c in summed.items()}


def workers_judge_traffic() -> int:
    """Degrade the workers real traffic condemns, restore those it no longer does; returns
    how many changed."""
    counts = fleet_window()
    changed = 0
    candidates = Worker.objects.filter(state__in=(WorkerState.ACTIVE, WorkerState.DEGRADED))
    for worker in candidates.only("pk", "state", "url", "name", "consecutive_failures"):
        requests, errors, _ = counts.get(worker.pk, (0, 0, 0))
        failing = _condemned(requests, errors)
        if worker.state == WorkerState.ACTIVE and failing:
            changed += _degrade(worker, _reason(requests, errors))
        elif worker.state == WorkerState.DEGRADED and not failing:
            changed += _restore(worker, requests, errors)
    return changed


def _condemned(requests: int, errors: int) -> bool:
    return (
        requests >= settings.CONTROLPANEL_DEGRADED_MIN_REQUESTS
        and errors / requests >= settings.CONTROLPANEL_DEGRADED_ERROR_RATE
    )


def _reason(requests: int, errors: int) -> str:
    window = settings.CONTROLPANEL_DEGRADED_WINDOW
    threshold = settings.CONTROLPANEL_DEGRADED_ERROR_RATE
    return (
        f"{errors} of {requests} requests failed ({errors / requests:.0%}) in the last "
        f"{window:g} s; the threshold is {threshold:.0%} of at least "
        f"{settings.CONTROLPANEL_DEGRADED_MIN_REQUESTS}"
    )


def _degrade(worker: Worker, reason: str) -> int:
    with transaction.atomic():
        moved = Worker.objects.filter(pk=worker.pk, state=WorkerState.ACTIVE).update(
            state=WorkerState.DEGRADED, degraded_reason=reason, updated_at=timezone.now()
        )
        if moved:
            event_record(
                kind=EventKind.WORKER_DEGRADED, worker=worker, message=reason, actor=TRAFFIC_ACTOR
            )
            RoutingGeneration.bump()
    if moved:
        log.warning("worker %s degraded: %s", worker.name, reason)
    return moved


def _restore(worker: Worker, requests: int, errors: int) -> int:
    if worker.consecutive_failures:
        return 0  # its probes fail: the probes' own rules decide, not traffic
    message = (
        f"traffic succeeds again ({errors} of {requests} failed in the last "
        f"{settings.CONTROLPANEL_DEGRADED_WINDOW:g} s) and probes pass"
    )
    with transaction.atomic():
        moved = Worker.objects.filter(pk=worker.pk, state=WorkerState.DEGRADED).update(
            state=WorkerState.ACTIVE, degraded_reason="", updated_at=timezone.now()
        )
        if moved:
            event_record(
                kind=EventKind.WORKER_RECOVERED,
                worker=worker,
                message=message,
                actor=TRAFFIC_ACTOR,
            )
            RoutingGeneration.bump()
    if moved:
        log.warning("worker %s recovered: %s", worker.name, message)
    return moved


def router_history_forget(*, instance_id: str) -> None:
    with _history_lock:
        _history.pop(instance_id, None)
