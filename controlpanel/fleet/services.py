"""The worker lifecycle, shared by the API, the dashboard, the agent's calls and the tasks.

Every function that changes what the router must see bumps RoutingGeneration in the same
transaction, so routers pick the change up on their next poll (well under a second).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlpanel.fleet import preflight, worker_fields
from controlpanel.fleet.discovery import (
    discover_models,
    kv_endpoints_settled,
    model_keys,
    models_from_agent,
)
from controlpanel.fleet.errors import (
    InvalidWeight,
    InvalidWorkerURL,
    LastRoutableWorker,
    WorkerAlreadyExists,
)
from controlpanel.fleet.kv_endpoints import kv_endpoints, kv_endpoints_given
from controlpanel.fleet.selectors import worker_inflight, worker_sole_models
from controlpanel.fleet.served_models import served_models_ensure
from controlpanel.registry.choices import EventKind, WorkerRole, WorkerSource, WorkerState
from controlpanel.registry.events import event_record, event_record_change, masked
from controlpanel.registry.models import (
    ROUTER_LIVENESS,
    RouterInstance,
    RoutingGeneration,
    Worker,
    normalize_worker_url,
)

log = logging.getLogger(__name__)


# What an operator (or an agent) sets on a worker, as the audit trail compares them; the
# upstream key has its own event (_worker_key_event), never its value.
WORKER_SETTINGS = (
    "name", "url", "weight", "role", "dcgm_url", "kv_events", "kv_events_replay",
    "gpu_count_max",
)  # fmt: skip


def worker_settings(worker: Worker) -> dict[str, Any]:
    return {field: getattr(worker, field) for field in WORKER_SETTINGS}


def _normalized(url: str) -> str:
    try:
        return normalize_worker_url(url)
    except ValueError as exc:
        raise InvalidWorkerURL(str(exc)) from exc


def _default_name(url: str) -> str:
    return url.split("://", 1)[1]


def worker_add(
    *,
    url: str,
    name: str = "",
    dcgm_url: str = "",
    api_key: str = "",
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
    role: str = WorkerRole.BOTH,
    actor: str,
) -> Worker:
    """An operator adds a server by URL; its models are discovered, never typed in.
    `api_key` is the key the server requires (vLLM's --api-key), if any; `kv_events` and
    `kv_events_replay` its KV cache events endpoints, which every router subscribes to:
    None (not given) reads them from the server (vLLM's GET /kv_event_sources), "" keeps
    them off, an endpoint given wins over what the server says. `role`: its part in
    prefill/decode disaggregation ("prefill", "decode" or "both", the default)."""
    normalized = _normalized(url)
    role = worker_fields.role(role)
    dcgm_url = worker_fields.dcgm_url(dcgm_url)
    api_key = worker_fields.api_key(api_key)
    given = kv_endpoints_given(kv_events, kv_events_replay)  # checked before any call goes out
    if Worker.objects.filter(url=normalized).exists():
        raise WorkerAlreadyExists(f"a worker with URL {normalized} is already registered")
    entries = discover_models(url=normalized, api_key=api_key)
    kv_events, kv_events_replay, kv_note = kv_endpoints_settled(
        given, url=normalized, api_key=api_key
    )
    with transaction.atomic():
        worker = Worker.objects.create(
            url=normalized,
            name=name or _default_name(normalized),
            source=WorkerSource.OPERATOR,
            models=entries,
            dcgm_url=dcgm_url,
            api_key=api_key,
            kv_events=kv_events,
            kv_events_replay=kv_events_replay,
            role=role,
        )
        served_models_ensure(entries)
        event_record(
            kind=EventKind.WORKER_JOINED,
            worker=worker,
            message=f"added with models {', '.join(worker.model_ids)}"
            f"{worker_fields.role_note(worker)}{worker_fields.key_note(worker)}{kv_note}",
            actor=actor,
            data={"before": {},
                  "after": masked({**worker_settings(worker), "api_key": worker.api_key})},
        )  # fmt: skip
        RoutingGeneration.bump()
    preflight.pools_preflight()  # it joined its models' pools: is it like them?
    return worker


def worker_register(
    *,
    url: str,
    models: list[Any] | None = None,
    name: str = "",
    dcgm_url: str | None = None,
    api_key: str | None = None,
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
    role: str | None = None,
    actor: str = "agent",
) -> Worker:
    """Idempotent by URL: an agent calls it at start and again whenever the controller has
    forgotten it, and each call leaves one up-to-date row. `dcgm_url`, `api_key`,
    `kv_events` and `role` None leave the worker's DCGM exporter, key, KV events endpoints
    and role as they were (an operator may have set them; a new row's role is "both"); a
    first registration without `kv_events` reads them from the server, as worker_add does
    ("" keeps them off)."""
    normalized = _normalized(url)
    role = None if role is None else worker_fields.role(role)
    given = kv_endpoints_given(kv_events, kv_events_replay)
    exporter = None if dcgm_url is None else worker_fields.dcgm_url(dcgm_url)
    key = None if api_key is None else worker_fields.api_key(api_key)
    row_key = Worker.objects.filter(url=normalized).values_list("api_key", flat=True).first()
    if key is None:
        key = row_key
    entries = (
        models_from_agent(models) if models else discover_models(url=normalized, api_key=key or "")
    )
    # None leaves a known row's endpoints as they are (an operator may have set them, or
    # cleared them on purpose); a new row without endpoints given reads the server's.
    kv: tuple[str, str] | None = None
    kv_note = ""
    if given[0] is not None:
        kv = (given[0], given[1] or "")
    elif row_key is None:
        stream, replay, kv_note = kv_endpoints_settled(given, url=normalized, api_key=key or "")
        kv = (stream, replay)
    now = timezone.now()
    with transaction.atomic():
        worker, created = Worker.objects.select_for_update().get_or_create(
            url=normalized,
            defaults={
                "name": name or _default_name(normalized),
                "source": WorkerSource.AGENT,
                "models": entries,
                "last_heartbeat": now,
                "dcgm_url": exporter or "",
                "api_key": key or "",
                "kv_events": kv[0] if kv else "",
                "kv_events_replay": kv[1] if kv else "",
                "role": role or WorkerRole.BOTH,
            },
        )
        if created:
            event_record(
                kind=EventKind.WORKER_JOINED,
                worker=worker,
                message=f"registered with models {', '.join(worker.model_ids)}"
                f"{worker_fields.role_note(worker)}{worker_fields.key_note(worker)}{kv_note}",
                actor=actor,
            )
        else:
            before = worker_settings(worker)
            if exporter is not None and exporter != worker.dcgm_url:
                worker_fields.dcgm_url_set(worker, exporter)
            if api_key is not None and key != worker.api_key:
                worker_fields.worker_key_event(worker, key or "", actor)
                worker.api_key = key or ""  # saved with the rest by _reregister
            if kv is not None:
                worker.kv_events, worker.kv_events_replay = kv
            if role is not None:
                worker.role = role  # saved with the rest by _reregister
            _reregister(worker, entries=entries, name=name, now=now, actor=actor)
            _settings_event(worker, before, actor)
        served_models_ensure(entries)
        RoutingGeneration.bump()
    preflight.pools_preflight()  # a (re)started server may run another version
    return worker


def _reregister(
    worker: Worker, *, entries: list[dict[str, Any]], name: str, now: datetime, actor: str
) -> None:
    if model_keys(worker.models) != model_keys(entries):
        event_record(
            kind=EventKind.MODELS_CHANGED,
            worker=worker,
            message=f"models now {', '.join(e['id'] for e in entries)}",
            actor=actor,
        )
    # Registration means a (re)started server, as in FastChat: it rejoins the rotation,
    # whatever state its previous life ended in; nothing of that life is still in flight.
    if worker.state != WorkerState.ACTIVE:
        event_record(
            kind=EventKind.WORKER_BACK,
            worker=worker,
            message=f"registered again (was {worker.state})",
            actor=actor,
        )
        worker.state = WorkerState.ACTIVE
    worker.models = entries
    worker.name = name or worker.name
    worker.source = WorkerSource.AGENT
    worker.last_heartbeat = now
    worker.save()


def worker_heartbeat(
    *, worker_id: int, queue_length: int | None = None, gpus: list[Any] | None = None
) -> Worker:
    """Raises Worker.DoesNotExist for an unknown id, which tells the agent to register.
    `gpus` are the agent's NVML readings (None: the agent has no GPU to report)."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        worker.last_heartbeat = timezone.now()
        fields = ["last_heartbeat", "updated_at"]
        if queue_length is not None:
            worker.queue_length, worker.queue_length_at = queue_length, worker.last_heartbeat
            fields += ["queue_length", "queue_length_at"]
        if gpus is not None:
            fields += worker_fields.record_nvml(worker, gpus, now=worker.last_heartbeat)
        if worker.state == WorkerState.OFFLINE:
            worker.state = WorkerState.ACTIVE
            fields.append("state")
            event_record(
                kind=EventKind.WORKER_BACK,
                worker=worker,
                message="heartbeat resumed",
                actor="agent",
            )
        worker.save(update_fields=fields)
        RoutingGeneration.bump()
    return worker


def worker_refuse_if_last(*, worker: Worker, action: str) -> None:
    """An operator's drain or removal of a model's last routable worker is refused unless
    forced: the reason names the models and what is in flight on it now."""
    models = worker_sole_models(worker)
    if not models:
        return
    inflight = worker_inflight(worker.pk)
    names = ", ".join(models)
    raise LastRoutableWorker(
        f"{worker.name} is the last routable worker of {names} ({inflight} request"
        f"{'' if inflight == 1 else 's'} in flight): {action} it leaves {names} with no worker, "
        "and its clients get 503; confirm (API: ?force=1) to do it anyway"
    )


def worker_drain(*, worker_id: int, actor: str, refuse_last: bool = False) -> Worker:
    """Stop new requests; the state becomes drained once no router has one in flight.
    `refuse_last`: an operator's unconfirmed drain of a model's last routable worker is
    refused (LastRoutableWorker); agents and rollouts drain as they must."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        if worker.state in (WorkerState.DRAINING, WorkerState.DRAINED):
            return worker
        if refuse_last:
            worker_refuse_if_last(worker=worker, action="draining")
        RoutingGeneration.bump()
        previous, worker.state = worker.state, WorkerState.DRAINING
        worker.drain_generation = RoutingGeneration.current()
        worker.save(update_fields=["state", "drain_generation", "updated_at"])
        event_record(
            kind=EventKind.DRAIN_STARTED,
            worker=worker,
            message="drain requested",
            actor=actor,
            data=_state_change(previous, WorkerState.DRAINING),
        )
    workers_finish_drains()
    worker.refresh_from_db()
    return worker


def worker_activate(*, worker_id: int, actor: str) -> Worker:
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        if worker.state == WorkerState.ACTIVE:
            return worker
        previous = worker.state
        worker.state = WorkerState.ACTIVE
        if worker.source == WorkerSource.AGENT:
            # Give an agent's worker a full expiry window to prove it is alive.
            worker.last_heartbeat = timezone.now()
        worker.save(update_fields=["state", "last_heartbeat", "updated_at"])
        event_record(
            kind=EventKind.WORKER_ACTIVATED,
            worker=worker,
            message=f"activated (was {previous})",
            actor=actor,
            data=_state_change(previous, WorkerState.ACTIVE),
        )
        RoutingGeneration.bump()
    return worker


def worker_remove(*, worker_id: int, actor: str, refuse_last: bool = False) -> None:
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        if refuse_last:
            worker_refuse_if_last(worker=worker, action="removing")
        event_record(
            kind=EventKind.WORKER_LEFT,
            worker=None,
            message=f"removed {worker.name} ({worker.url})",
            actor=actor,
            data={"worker_id": worker.pk, "url": worker.url,
                  **_state_change(worker.state, "removed")},
        )  # fmt: skip
        worker.delete()
        RoutingGeneration.bump()


def workers_expire_heartbeats(*, now: datetime | None = None) -> int:
    """Agents' workers whose heartbeat is older than the expiry leave the rotation."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.CONTROLPANEL_HEARTBEAT_EXPIRY)
    stale = Worker.objects.filter(
        source=WorkerSource.AGENT,
        state=WorkerState.ACTIVE,
        last_heartbeat__lt=cutoff,
    )
    expired = 0
    for worker in stale:
        with transaction.atomic():
            changed = Worker.objects.filter(
                pk=worker.pk, state=WorkerState.ACTIVE, last_heartbeat__lt=cutoff
            ).update(state=WorkerState.OFFLINE, updated_at=now)
            if changed:
                expired += 1
                event_record(
                    kind=EventKind.WORKER_OFFLINE,
                    worker=worker,
                    message=f"no heartbeat for {settings.CONTROLPANEL_HEARTBEAT_EXPIRY} s",
                    actor="heartbeat-expiry",
                )
                RoutingGeneration.bump()
    return expired


def workers_finish_drains() -> int:
    """A draining worker becomes drained once every live router has reported from a
    snapshot that knows of the drain, with nothing in flight on that worker."""
    draining = list(Worker.objects.filter(state=WorkerState.DRAINING))
    if not draining:
        return 0
    routers = list(RouterInstance.live(ROUTER_LIVENESS).values_list("generation", "inflight"))
    finished = 0
    for worker in draining:
        if not _drain_complete(worker, routers):
            continue
        with transaction.atomic():
            if Worker.objects.filter(pk=worker.pk, state=WorkerState.DRAINING).update(
                state=WorkerState.DRAINED, updated_at=timezone.now()
            ):
                finished += 1
                event_record(
                    kind=EventKind.DRAIN_FINISHED,
                    worker=worker,
                    message="no request left in flight",
                    actor="router",
                )
                RoutingGeneration.bump()
    return finished


def _drain_complete(worker: Worker, routers: list[tuple[int, dict[str, int]]]) -> bool:
    needed = worker.drain_generation or 0
    return all(
        generation >= needed and not inflight.get(str(worker.pk))
        for generation, inflight in routers
    )


def worker_update(
    *,
    worker_id: int,
    name: str | None,
    weight: float | None,
    actor: str,
    dcgm_url: str | None = None,
    reset_gpu_count: bool = False,
    api_key: str | None = None,
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
    role: str | None = None,
) -> Worker:
    """`dcgm_url` "" removes the exporter; `reset_gpu_count` accepts the GPU count the
    worker reports now (after a GPU was removed on purpose), ending a "fewer GPUs" warning.
    `api_key` "" removes the worker's key, None leaves it; so do `kv_events` and
    `kv_events_replay` for its KV cache events endpoints. `role` None leaves it."""
    if weight is not None and weight < 0:
        raise InvalidWeight("weight cannot be negative")
    role = None if role is None else worker_fields.role(role)
    exporter = None if dcgm_url is None else worker_fields.dcgm_url(dcgm_url)
    key = None if api_key is None else worker_fields.api_key(api_key)
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        before = worker_settings(worker)
        if name:
            worker.name = name
        if weight is not None:
            worker.weight = weight
        if role is not None:
            worker.role = role
        fields = ["name", "weight", "role", "updated_at"]
        if exporter is not None and exporter != worker.dcgm_url:
            fields += worker_fields.dcgm_url_set(worker, exporter)
        if key is not None and key != worker.api_key:
            worker_fields.worker_key_event(worker, key, actor)
            worker.api_key = key
            fields.append("api_key")
        if kv_events is not None or kv_events_replay is not None:
            worker.kv_events, worker.kv_events_replay = kv_endpoints(
                worker.kv_events if kv_events is None else kv_events,
                worker.kv_events_replay if kv_events_replay is None else kv_events_replay,
            )
            fields += ["kv_events", "kv_events_replay"]
        if reset_gpu_count:
            worker.gpu_count_max = len(worker.gpus) if worker.gpus_source else None
            worker.gpu_warnings = [w for w in worker.gpu_warnings if w["key"] != "count"]
            fields += ["gpu_count_max", "gpu_warnings"]
        worker.save(update_fields=fields)
        _settings_event(worker, before, actor)
        RoutingGeneration.bump()
    return worker


def _settings_event(worker: Worker, before: dict[str, Any], actor: str) -> None:
    event_record_change(
        kind=EventKind.WORKER_CHANGED,
        worker=worker,
        before=before,
        after=worker_settings(worker),
        actor=actor,
    )


def _state_change(before: str, after: str) -> dict[str, Any]:
    return {"before": {"state": str(before)}, "after": {"state": str(after)}}
