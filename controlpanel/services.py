"""Business logic of the registry, shared by the API, the admin, commands and tasks.

Every function that changes what the router must see bumps RoutingGeneration in the same
transaction, so routers pick the change up on their next poll (well under a second).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from controlpanel import gpu, gpu_health, probes
from controlpanel.models import (
    Event,
    EventKind,
    RouterInstance,
    RoutingGeneration,
    ServedModel,
    Worker,
    WorkerSource,
    WorkerState,
    normalize_worker_url,
)

log = logging.getLogger(__name__)

# A router that has not reported for this long is presumed gone: its in-flight counts no
# longer hold a drain open.
ROUTER_LIVENESS = timedelta(seconds=15)
MAX_MODEL_NAME = ServedModel._meta.get_field("name").max_length or 300


class ServiceError(Exception):
    """A refusal with a message meant for the person or agent that asked."""

    status = 400


class InvalidWorkerURL(ServiceError):
    status = 422


class InvalidWorkerKey(ServiceError):
    status = 422


class WorkerUnreachable(ServiceError):
    status = 422


class NotAVllmServer(ServiceError):
    status = 422


class WorkerAlreadyExists(ServiceError):
    status = 409


class InvalidTransition(ServiceError):
    status = 409


class InvalidPolicy(ServiceError):
    status = 422


class InvalidWeight(ServiceError):
    status = 422


# --- discovery ---------------------------------------------------------------------------


def discover_models(*, url: str, api_key: str = "") -> list[dict[str, Any]]:
    """Ask a server's /v1/models what it serves, refusing anything that is not vLLM-like."""
    endpoint = f"{url}/v1/models"
    try:
        response = httpx.get(
            endpoint,
            headers=probes.worker_auth(api_key),
            timeout=settings.CONTROLPANEL_DISCOVERY_TIMEOUT,
        )
    except httpx.HTTPError as exc:
        raise WorkerUnreachable(f"cannot reach {endpoint}: {exc}") from exc
    if response.status_code == 401:
        hint = "the worker's API key is wrong" if api_key else "set the worker's API key"
        raise NotAVllmServer(f"{endpoint} answered HTTP 401: {hint} (vLLM's --api-key)")
    if response.status_code != 200:
        raise NotAVllmServer(f"{endpoint} answered HTTP {response.status_code}, not a model list")
    try:
        return parse_model_list(response.json())
    except (ValueError, TypeError, KeyError) as exc:
        raise NotAVllmServer(f"{endpoint} did not return an OpenAI model list: {exc}") from exc


def parse_model_list(payload: Any) -> list[dict[str, Any]]:
    """Keep what routing needs from vLLM's list, in its order, one entry per id."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("expected {'object': 'list', 'data': [...]}")
    seen: dict[str, dict[str, Any]] = {}
    for entry in payload["data"]:
        model_id = entry["id"]
        # Longer than the ServedModel column, the write would fail (PostgreSQL) later.
        if not isinstance(model_id, str) or not model_id or len(model_id) > MAX_MODEL_NAME:
            raise ValueError(f"bad model id {model_id!r}")
        seen.setdefault(model_id, _model_entry(entry))
    if not seen:
        raise ValueError("the server lists no model")
    return list(seen.values())


def _model_entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": entry["id"],
        "parent": entry.get("parent"),
        "root": entry.get("root"),
        "max_model_len": entry.get("max_model_len"),
        "created": entry.get("created"),
    }


def model_keys(entries: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What identifies a model list; not `created`, which vLLM stamps with the current time
    on every /v1/models answer."""
    return [(e.get("id"), e.get("parent"), e.get("root"), e.get("max_model_len")) for e in entries]


def models_from_agent(names_or_entries: Iterable[Any]) -> list[dict[str, Any]]:
    """An agent may send bare names or vLLM entries; both become vLLM entries."""
    entries = [{"id": item} if isinstance(item, str) else dict(item) for item in names_or_entries]
    try:
        return parse_model_list({"data": entries})
    except (ValueError, TypeError, KeyError) as exc:
        raise NotAVllmServer(f"the agent's model list is not usable: {exc}") from exc


# --- events --------------------------------------------------------------------------------


def event_record(
    *,
    kind: str,
    worker: Worker | None,
    message: str,
    actor: str,
    data: dict[str, Any] | None = None,
) -> Event:
    return Event.objects.create(
        kind=kind,
        worker=worker,
        subject=worker.url if worker else "",
        message=message,
        actor=actor,
        data=data or {},
    )


# --- worker lifecycle ----------------------------------------------------------------------


def _normalized(url: str) -> str:
    try:
        return normalize_worker_url(url)
    except ValueError as exc:
        raise InvalidWorkerURL(str(exc)) from exc


def _default_name(url: str) -> str:
    return url.split("://", 1)[1]


def served_models_ensure(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        ServedModel.objects.get_or_create(name=entry["id"])


def worker_add(
    *, url: str, name: str = "", dcgm_url: str = "", api_key: str = "", actor: str
) -> Worker:
    """An operator adds a server by URL; its models are discovered, never typed in.
    `api_key` is the key the server requires (vLLM's --api-key), if any."""
    normalized = _normalized(url)
    dcgm_url = _dcgm_url(dcgm_url)
    api_key = _api_key(api_key)
    if Worker.objects.filter(url=normalized).exists():
        raise WorkerAlreadyExists(f"a worker with URL {normalized} is already registered")
    entries = discover_models(url=normalized, api_key=api_key)
    with transaction.atomic():
        worker = Worker.objects.create(
            url=normalized,
            name=name or _default_name(normalized),
            source=WorkerSource.OPERATOR,
            models=entries,
            dcgm_url=dcgm_url,
            api_key=api_key,
        )
        served_models_ensure(entries)
        event_record(
            kind=EventKind.WORKER_JOINED,
            worker=worker,
            message=f"added with models {', '.join(worker.model_ids)}{_key_note(worker)}",
            actor=actor,
        )
        RoutingGeneration.bump()
    return worker


def worker_register(
    *,
    url: str,
    models: list[Any] | None = None,
    name: str = "",
    dcgm_url: str | None = None,
    api_key: str | None = None,
    actor: str = "agent",
) -> Worker:
    """Idempotent by URL: an agent calls it at start and again whenever the controller has
    forgotten it, and each call leaves one up-to-date row. `dcgm_url` and `api_key` None
    leave the worker's DCGM exporter and key as they were (an operator may have set them)."""
    normalized = _normalized(url)
    exporter = None if dcgm_url is None else _dcgm_url(dcgm_url)
    key = None if api_key is None else _api_key(api_key)
    if key is None:
        key = Worker.objects.filter(url=normalized).values_list("api_key", flat=True).first()
    entries = (
        models_from_agent(models) if models else discover_models(url=normalized, api_key=key or "")
    )
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
            },
        )
        if created:
            event_record(
                kind=EventKind.WORKER_JOINED,
                worker=worker,
                message=f"registered with models {', '.join(worker.model_ids)}{_key_note(worker)}",
                actor=actor,
            )
        else:
            if exporter is not None and exporter != worker.dcgm_url:
                _dcgm_url_set(worker, exporter)
            if api_key is not None and key != worker.api_key:
                _worker_key_event(worker, key or "", actor)
                worker.api_key = key or ""  # saved with the rest by _reregister
            _reregister(worker, entries=entries, name=name, now=now, actor=actor)
        served_models_ensure(entries)
        RoutingGeneration.bump()
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
            worker.queue_length = queue_length
            fields.append("queue_length")
        if gpus is not None:
            fields += _record_nvml(worker, gpus, now=worker.last_heartbeat)
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


def worker_drain(*, worker_id: int, actor: str) -> Worker:
    """Stop new requests; the state becomes drained once no router has one in flight."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        if worker.state in (WorkerState.DRAINING, WorkerState.DRAINED):
            return worker
        RoutingGeneration.bump()
        worker.state = WorkerState.DRAINING
        worker.drain_generation = RoutingGeneration.current()
        worker.save(update_fields=["state", "drain_generation", "updated_at"])
        event_record(
            kind=EventKind.DRAIN_STARTED, worker=worker, message="drain requested", actor=actor
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
        )
        RoutingGeneration.bump()
    return worker


def worker_remove(*, worker_id: int, actor: str) -> None:
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        event_record(
            kind=EventKind.WORKER_LEFT,
            worker=None,
            message=f"removed {worker.name} ({worker.url})",
            actor=actor,
            data={"worker_id": worker.pk, "url": worker.url},
        )
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


def router_report(
    *,
    instance_id: str,
    hostname: str,
    pid: int,
    started_at: datetime,
    generation: int,
    inflight: dict[int, int],
    recent: dict[int, tuple[int, int]] | None = None,
    traffic: dict[str, dict[str, Any]] | None = None,
) -> bool:
    """A router says it is alive and what it has in flight; drains may then finish.

    Returns whether this router is the one that exports the fleet's worker gauges on its
    /metrics (the longest-running live router), so several replicas never double-count."""
    RouterInstance.objects.update_or_create(
        instance_id=instance_id,
        defaults={
            "hostname": hostname,
            "pid": pid,
            "started_at": started_at,
            "last_seen": timezone.now(),
            "inflight": {str(k): v for k, v in inflight.items() if v},
            "generation": generation,
            "recent": {str(k): list(v) for k, v in (recent or {}).items() if v[0]},
            "traffic": traffic or {},
        },
    )
    RouterInstance.objects.filter(last_seen__lt=timezone.now() - ROUTER_LIVENESS * 20).delete()
    workers_finish_drains()
    oldest = (
        RouterInstance.live(ROUTER_LIVENESS)
        .order_by("started_at", "instance_id")
        .values_list("instance_id", flat=True)
        .first()
    )
    return oldest == instance_id


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


# --- models and policies ---------------------------------------------------------------


def served_model_set_policy(
    *, name: str, policy: str, policy_config: dict[str, Any] | None, actor: str
) -> ServedModel:
    """Change how a model's requests are balanced; routers apply it on their next poll.
    The configuration is checked by building the policy here, so a typo is refused now
    rather than discovered by the router."""
    from routing.policies import UnknownPolicy, policy_class

    config = policy_config or {}
    try:
        policy_class(policy)(config)
    except (UnknownPolicy, ValueError, TypeError) as exc:
        raise InvalidPolicy(str(exc)) from exc
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        previous = model.policy
        model.policy, model.policy_config = policy, config
        model.save(update_fields=["policy", "policy_config", "updated_at"])
        event_record(
            kind=EventKind.POLICY_CHANGED,
            worker=None,
            message=f"{name}: {previous} -> {policy} {config or ''}".rstrip(),
            actor=actor,
            data={"model": name, "policy": policy, "policy_config": config},
        )
        RoutingGeneration.bump()
    return model


def served_model_set_limit(*, name: str, max_inflight: int, actor: str) -> ServedModel:
    """Cap the requests in flight for one model per router (0: no cap); beyond it requests
    wait in a bounded queue, then get 429 (routing.admission)."""
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        model.max_inflight = max_inflight
        model.save(update_fields=["max_inflight", "updated_at"])
        limit = f"at most {max_inflight} in flight per router" if max_inflight else "no limit"
        event_record(
            kind=EventKind.POLICY_CHANGED,
            worker=None,
            message=f"{name}: {limit}",
            actor=actor,
            data={"model": name, "max_inflight": max_inflight},
        )
        RoutingGeneration.bump()
    return model


def worker_update(
    *,
    worker_id: int,
    name: str | None,
    weight: float | None,
    actor: str,
    dcgm_url: str | None = None,
    reset_gpu_count: bool = False,
    api_key: str | None = None,
) -> Worker:
    """`dcgm_url` "" removes the exporter; `reset_gpu_count` accepts the GPU count the
    worker reports now (after a GPU was removed on purpose), ending a "fewer GPUs" warning.
    `api_key` "" removes the worker's key, None leaves it."""
    if weight is not None and weight < 0:
        raise InvalidWeight("weight cannot be negative")
    exporter = None if dcgm_url is None else _dcgm_url(dcgm_url)
    key = None if api_key is None else _api_key(api_key)
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        if name:
            worker.name = name
        if weight is not None:
            worker.weight = weight
        fields = ["name", "weight", "updated_at"]
        if exporter is not None and exporter != worker.dcgm_url:
            fields += _dcgm_url_set(worker, exporter)
        if key is not None and key != worker.api_key:
            _worker_key_event(worker, key, actor)
            worker.api_key = key
            fields.append("api_key")
        if reset_gpu_count:
            worker.gpu_count_max = len(worker.gpus) if worker.gpus_source else None
            worker.gpu_warnings = [w for w in worker.gpu_warnings if w["key"] != "count"]
            fields += ["gpu_count_max", "gpu_warnings"]
        worker.save(update_fields=fields)
        RoutingGeneration.bump()
    return worker


# --- GPU telemetry (controlpanel.gpu, controlpanel.gpu_health) ------------------------------


def _key_note(worker: Worker) -> str:
    return " and an upstream API key" if worker.api_key else ""


def _worker_key_event(worker: Worker, new_key: str, actor: str) -> None:
    """The audit trail says that a worker's upstream key changed, never what it is."""
    what = "removed" if not new_key else "rotated" if worker.api_key else "set"
    event_record(
        kind=EventKind.WORKER_KEY_CHANGED,
        worker=worker,
        message=f"upstream API key {what}",
        actor=actor,
        data={"change": what},
    )


def _api_key(key: str) -> str:
    """A worker key goes into an HTTP header: printable ASCII without spaces, or nothing."""
    key = key.strip()
    if len(key) > 512 or not all("!" <= ch <= "~" for ch in key):
        raise InvalidWorkerKey("a worker API key is up to 512 printable ASCII characters")
    return key


def _dcgm_url(url: str) -> str:
    try:
        return gpu.normalize_dcgm_url(url)
    except ValueError as exc:
        raise InvalidWorkerURL(str(exc)) from exc


def _dcgm_url_set(worker: Worker, url: str) -> list[str]:
    """A new exporter may see other GPUs: start from "unknown" rather than compare them.
    Returns the fields changed."""
    worker.dcgm_url = url
    forget = gpu_health.gpu_forget()
    for name, value in forget.items():
        setattr(worker, name, value)
    return ["dcgm_url", *forget]


def _record_nvml(worker: Worker, raw: list[Any], *, now: datetime) -> list[str]:
    """Apply the agent's NVML readings (unless the worker's DCGM exporter has fresh ones);
    returns the fields changed."""
    readings = gpu.clean_gpus(raw) or []
    change = gpu_health.gpu_change(worker, gpus=readings, source=gpu_health.NVML, now=now)
    for name, value in change.fields.items():
        setattr(worker, name, value)
    for kind, message in change.events:
        event_record(kind=kind, worker=worker, message=message, actor="agent")
    return list(change.fields)


# --- accounts ------------------------------------------------------------------------------


def admin_bootstrap() -> str | None:
    """On a first run with no staff user, make `admin` with a random password and return
    the password (the caller prints it once); otherwise return None."""
    user_model = get_user_model()
    if user_model.objects.filter(is_staff=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    user_model.objects.create_superuser(username="admin", email="", password=password)
    return password


def routing_changed() -> None:
    """For edits made outside these services (Django admin forms): tell the routers."""
    RoutingGeneration.bump()
