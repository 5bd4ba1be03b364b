"""Services that turn probe results and routers' failure reports into registry state.

* **Hysteresis.** One lost probe says little (a GC pause, a busy event loop). A worker leaves
  the rotation only after CONTROLPANEL_UNHEALTHY_AFTER failures in a row and comes back only
  after CONTROLPANEL_HEALTHY_AFTER successes in a row, so a flaky server does not flap in
  and out of every router's snapshot. Routers' reports of refused or reset connections
  count as failures too, so a dead server under traffic leaves within seconds, not at the
  next probe.
* **Only active <-> unhealthy.** Draining, drained and offline are the operator's or the
  heartbeat expiry's decisions; probes keep those workers' counters and metrics current
  but never change their state. Each write is conditional on the state read under the row
  lock, so a probe result applied while an operator drains the worker cannot undo the drain.
* **Fresh load signals.** Every round bumps the routing generation once (not once per
  worker), so routers rebuild their snapshot with the new queue lengths within a poll.
  Transitions (health, sleep, models) also bump in their own transaction, as every change
  the router must see does.
* **Little bookkeeping per round.** Old history is pruned at most once a minute, and pool
  preflight runs when a round changed something, when the set of workers changed, or
  otherwise once a minute (:class:`RoundTimer`, per process).
* **Never a made-up zero.** Metrics a server does not export are stored as None, and an
  unknown queue length leaves the last known one (an agent's heartbeat may also report it).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import DatabaseError, transaction
from django.utils import timezone

from controlpanel.fleet import discovery, gpu, gpu_health, preflight, probes
from controlpanel.fleet.discovery import parse_model_list
from controlpanel.fleet.served_models import served_models_ensure
from controlpanel.registry.choices import EventKind, WorkerState
from controlpanel.registry.events import event_record
from controlpanel.registry.models import RoutingGeneration, Worker, WorkerSample

log = logging.getLogger(__name__)

PROBE_ACTOR = "probe"
ROUTER_ACTOR = "router"
# Two overlapping rounds would count one failure twice; with a shared cache (Redis) this
# also holds across Celery processes.
ROUND_LOCK_KEY = "controlpanel:probe-round"


@dataclass
class _Update:
    """What one probe or report changes on one worker, written in one conditional update."""

    fields: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (kind, message)
    served_models: list[dict[str, Any]] | None = None


# --- the probe round -----------------------------------------------------------------------


def workers_probe() -> int:
    """Probe every registered worker at once and apply the results; returns how many were
    applied (0 when another round is still running)."""
    lock_seconds = max(30.0, 10 * settings.CONTROLPANEL_PROBE_TIMEOUT)
    if not cache.add(ROUND_LOCK_KEY, True, timeout=lock_seconds):
        log.info("the previous probe round is still running; skipping this one")
        return 0
    try:
        results = probes.probe_many(probe_targets(), timeout=settings.CONTROLPANEL_PROBE_TIMEOUT)
        # The loop has stopped by now: the ORM runs here, in plain synchronous code.
        outcomes = [_apply_logged(result) for result in results]
        if PRUNE_TIMER.due():
            samples_prune()
        probed = frozenset(result.worker_id for result in results)
        if _preflight_due(changed=any(outcomes), probed=probed):
            _preflight_logged()
        if any(outcomes):  # a round that changed nothing routers read costs them nothing
            with transaction.atomic():
                RoutingGeneration.bump()
        return sum(outcome is not None for outcome in outcomes)
    finally:
        cache.delete(ROUND_LOCK_KEY)


class RoundTimer:
    """ "At most once every `seconds`" for a round's bookkeeping, in this process; `due`
    says whether it is time (or `now` asks for it anyway) and, if so, starts the wait."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = -math.inf

    def due(self, *, now: bool = False) -> bool:
        at = time.monotonic()
        if not now and at - self.last < self.seconds:
            return False
        self.last = at
        return True

    def reset(self) -> None:
        self.last = -math.inf


# History is kept CONTROLPANEL_HISTORY_MINUTES (15 at least): pruning once a minute rather
# than every round keeps it within a minute of that and saves a DELETE per round.
PRUNE_TIMER = RoundTimer(60.0)
# Preflight compares what the round read (model lists, cache config) across pools: needed
# when a round changed something, or the set of workers changed; otherwise once a minute,
# which also catches what changed outside the probes.
PREFLIGHT_TIMER = RoundTimer(60.0)
_preflight_workers: frozenset[int] = frozenset()


def _preflight_due(*, changed: bool, probed: frozenset[int]) -> bool:
    global _preflight_workers
    new_set, _preflight_workers = probed != _preflight_workers, probed
    return PREFLIGHT_TIMER.due(now=changed or new_set)


def round_timers_reset() -> None:
    """The next round prunes and runs preflight whatever the last did (tests)."""
    global _preflight_workers
    PRUNE_TIMER.reset()
    PREFLIGHT_TIMER.reset()
    _preflight_workers = frozenset()


def _preflight_logged() -> None:
    """Pools compared again with this round's readings (cache config, model lists); a
    failure there must not cost the round its results."""
    try:
        preflight.pools_preflight()
    except Exception:
        PREFLIGHT_TIMER.reset()
        log.exception("pool preflight failed; the next round tries again")


def _apply_logged(result: probes.ProbeResult) -> bool | None:
    # One worker's database trouble must not cost every other worker its result.
    try:
        return _apply(result)
    except DatabaseError:
        log.exception("could not apply the probe result of worker %s", result.worker_id)
        return None


def probe_targets() -> list[probes.ProbeTarget]:
    every = settings.CONTROLPANEL_MODELS_EVERY
    rows = Worker.objects.values_list("pk", "url", "scrape_state", "dcgm_url", "api_key")
    return [
        probes.ProbeTarget(
            worker_id=pk,
            url=url,
            read_models=_models_due(state, every),
            dcgm_url=dcgm_url,
            api_key=api_key,
        )
        for pk, url, state, dcgm_url, api_key in rows
    ]


def _models_due(scrape_state: Any, every: int) -> bool:
    since = scrape_state.get("probes_since_models") if isinstance(scrape_state, dict) else None
    return not isinstance(since, int) or since + 1 >= every


# What a probe writes that no router's snapshot reads: the probe's own bookkeeping and the
# times of its readings (routers take the queue and its time from the load reports, every
# second). A round that changes only these leaves the routing generation where it was, so an
# idle fleet does not make every router rebuild its snapshot at every probe.
UNSEEN_BY_ROUTERS = frozenset(
    {"last_probe_at", "queue_length_at", "scrape_state", "consecutive_successes",
     "consecutive_failures", "last_error"}
)  # fmt: skip


def probe_result_apply(*, result: probes.ProbeResult) -> bool:
    """Apply one probe's result; False when the worker is gone or its state moved under us."""
    return _apply(result) is not None


def _apply(result: probes.ProbeResult) -> bool | None:
    """None when not applied; else whether it changed anything routers read."""
    with transaction.atomic():
        worker = _locked(result.worker_id)
        if worker is None:
            return None  # removed while the probe ran
        previous = worker.scrape_state if isinstance(worker.scrape_state, dict) else {}
        reading = probes.read_metrics(
            result.metrics_text, previous=previous, at=result.at, worker=result.worker_id
        )
        update = _Update()
        _count_probe(update, worker, up=result.up, error=result.error)
        _record_load(update, reading, at=result.at)
        _track_sleep(update, worker, reading.sleeping)
        since = _track_models(update, worker, result, previous.get("probes_since_models"))
        update.fields["scrape_state"] = {**reading.counters, "probes_since_models": since}
        _track_gpus(update, worker, result)
        seen = _routers_see(worker, update)
        if not _write(worker, update, actor=PROBE_ACTOR):
            return None
        _sample(worker, result, reading.metrics, gpus=_sampled_gpus(worker, update))
    return seen


def _locked(worker_id: int) -> Worker | None:
    """The row under its lock, by primary key alone (no ORDER BY, as .first() adds): the
    same SELECT ... FOR UPDATE every time."""
    try:
        return Worker.objects.select_for_update().get(pk=worker_id)
    except Worker.DoesNotExist:
        return None


def _routers_see(worker: Worker, update: _Update) -> bool:
    """Whether the update changes a field a router's snapshot is built from."""
    if update.events or update.served_models is not None:
        return True
    return any(
        getattr(worker, name) != value
        for name, value in update.fields.items()
        if name not in UNSEEN_BY_ROUTERS
    )


def _count_probe(update: _Update, worker: Worker, *, up: bool, error: str) -> None:
    if not up:
        failures = worker.consecutive_failures + 1
        _count_failures(
            update, worker, failures=failures, cause=f"{_plural(failures, 'failed probe')}: {error}"
        )
        update.fields["last_error"] = error
        return
    successes = worker.consecutive_successes + 1
    update.fields.update(consecutive_successes=successes, consecutive_failures=0, last_error="")
    if worker.state == WorkerState.UNHEALTHY and successes >= settings.CONTROLPANEL_HEALTHY_AFTER:
        update.fields["state"] = WorkerState.ACTIVE
        update.events.append((EventKind.WORKER_RECOVERED, _plural(successes, "successful probe")))


def _count_failures(
    update: _Update, worker: Worker, *, failures: int, cause: str, at_once: bool = False
) -> None:
    """Shared by probes and routers' reports: only an active (or degraded) worker turns
    unhealthy; `at_once` for what proves the server is not there (a refused connection)."""
    update.fields.update(consecutive_failures=failures, consecutive_successes=0)
    enough = at_once or failures >= settings.CONTROLPANEL_UNHEALTHY_AFTER
    if worker.state in (WorkerState.ACTIVE, WorkerState.DEGRADED) and enough:
        update.fields["state"] = WorkerState.UNHEALTHY
        update.events.append((EventKind.WORKER_UNHEALTHY, cause))


def _record_load(update: _Update, reading: probes.MetricsReading, *, at: float) -> None:
    metrics = reading.metrics
    read_at = datetime.fromtimestamp(at, tz=UTC)
    update.fields.update(metrics=metrics, last_probe_at=read_at)
    running, waiting = metrics["running"], metrics["waiting"]
    if running is not None and waiting is not None:
        update.fields.update(queue_length=running + waiting, queue_length_at=read_at)


def _track_sleep(update: _Update, worker: Worker, sleeping: bool | None) -> None:
    if sleeping is None or sleeping == worker.sleeping:
        return  # unknown this time: keep what we knew, a sleeper must not slip back in
    update.fields["sleeping"] = sleeping
    if sleeping:
        update.events.append((EventKind.WORKER_SLEEPING, "the engine is sleeping"))
    elif worker.sleeping:
        update.events.append((EventKind.WORKER_AWAKE, "the engine is awake again"))


def _track_models(update: _Update, worker: Worker, result: probes.ProbeResult, since: Any) -> int:
    """Refresh the model list when it was read; returns probes since the last good read
    (a failed read is retried at the next probe)."""
    stale = since + 1 if isinstance(since, int) else 1
    if not result.models_read:
        return stale
    try:
        entries = parse_model_list(result.models_payload)
    except (ValueError, TypeError, KeyError) as exc:
        # A server that is down says so through /health; only a live one is worth a warning.
        level = logging.WARNING if result.up else logging.DEBUG
        log.log(level, "cannot read the models of %s: %s", worker.url, result.models_error or exc)
        return stale
    if discovery.model_keys(entries) != discovery.model_keys(worker.models):
        update.fields["models"] = entries
        update.served_models = entries
        update.events.append((EventKind.MODELS_CHANGED, _models_message(worker.models, entries)))
    return 0


def _models_message(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    before, after = [e["id"] for e in old], [e["id"] for e in new]
    added = [m for m in after if m not in before]
    removed = [m for m in before if m not in after]
    parts = [f"models now {', '.join(after)}"]
    if added:
        parts.append(f"added {', '.join(added)}")
    if removed:
        parts.append(f"removed {', '.join(removed)}")
    return "; ".join(parts)


def _track_gpus(update: _Update, worker: Worker, result: probes.ProbeResult) -> None:
    """The DCGM exporter's readings, when the worker has one and it answered. One failed
    scrape changes nothing: the readings turn unknown once they are stale."""
    if not worker.dcgm_url:
        return
    readings = None if result.dcgm_text is None else gpu.parse_dcgm(result.dcgm_text)
    if readings is None:
        log.debug("no DCGM readings from %s: %s", worker.dcgm_url, result.dcgm_error)
        return
    at = datetime.fromtimestamp(result.at, tz=UTC)
    change = gpu_health.gpu_change(worker, gpus=readings, source=gpu_health.DCGM, now=at)
    update.fields.update(change.fields)
    update.events += change.events


def _sampled_gpus(worker: Worker, update: _Update) -> list[dict[str, Any]] | None:
    """What the history keeps of the GPUs: this probe's readings, or the agent's while fresh."""
    if "gpus" in update.fields:
        return gpu_health.chart_points(update.fields["gpus"])
    return gpu_health.chart_points(gpu_health.fresh_gpus(worker, timezone.now()))


def _write(worker: Worker, update: _Update, *, actor: str) -> bool:
    """The conditional write: only if the state is still the one these changes were
    computed from, and only the fields that differ from the row as read (an idle worker's
    metrics, its vLLM series among them, are tens of KiB of JSON a round would otherwise
    encode and write again; nothing at all when nothing differs). Then the events, and a
    generation bump if the router must see them."""
    changed = {k: v for k, v in update.fields.items() if getattr(worker, k) != v}
    if changed:
        written = Worker.objects.filter(pk=worker.pk, state=worker.state).update(
            **changed, updated_at=timezone.now()
        )
        if not written:
            log.info("state of %s changed while a result was applied; result dropped", worker.url)
            return False
    if update.served_models is not None:
        served_models_ensure(update.served_models)
    for kind, message in update.events:
        event_record(kind=kind, worker=worker, message=message, actor=actor)
    if update.events:
        RoutingGeneration.bump()
    return True


def _sample(
    worker: Worker,
    result: probes.ProbeResult,
    metrics: dict[str, Any],
    *,
    gpus: list[dict[str, Any]] | None = None,
) -> None:
    WorkerSample.objects.create(
        worker=worker,
        at=datetime.fromtimestamp(result.at, tz=UTC),
        up=result.up,
        running=metrics["running"],
        waiting=metrics["waiting"],
        kv_cache_usage=metrics["kv_cache_usage"],
        prefix_hit_rate=metrics["prefix_hit_rate"],
        ttft_p50=metrics["ttft_p50"],
        rps=metrics["rps"],
        gpus=gpus,
    )


def samples_prune(*, now: datetime | None = None) -> int:
    """Drop history older than CONTROLPANEL_HISTORY_MINUTES: nothing references a sample,
    so this is one indexed DELETE."""
    cutoff = (now or timezone.now()) - timedelta(minutes=settings.CONTROLPANEL_HISTORY_MINUTES)
    deleted, _ = WorkerSample.objects.filter(at__lt=cutoff).delete()
    return deleted


# --- routers' reports ------------------------------------------------------------------------


def worker_passive_failures(*, worker_id: int, failures: int, cause: str) -> bool:
    """Real requests to the worker were refused or reset: count them like failed probes.
    A refused connection (the router's kind "connect") makes it unhealthy at once: nothing
    listens there, and three probes would take seconds of clients' retries to agree.
    Returns True when this made the worker unhealthy."""
    if failures < 1:
        return False
    with transaction.atomic():
        worker = _locked(worker_id)
        if worker is None:
            return False
        total = worker.consecutive_failures + failures
        message = f"{_plural(failures, 'failed request')}: {cause}"
        if total != failures:
            message += f" ({total} failures in a row)"
        update = _Update(fields={"last_error": message})
        refused = cause.startswith("connect:")
        _count_failures(update, worker, failures=total, cause=message, at_once=refused)
        return _write(worker, update, actor=ROUTER_ACTOR) and bool(update.events)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
