"""Admin endpoints for workers: add, list, drain, activate, update, remove, and LoRA."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Router, Schema

from controlpanel.api.auth import ADMIN_AUTH
from controlpanel.api.limits import MAX_URL, MAX_WORKER_NAME
from controlpanel.api.strict import StrictIn
from controlpanel.fleet import loras, preflight, services
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.models import Worker

router = Router()

Role = Literal["prefill", "decode", "both"]  # registry.models.WorkerRole


class ModelOut(Schema):
    id: str
    parent: str | None = None


class WorkerOut(Schema):
    id: int
    name: str
    url: str
    state: str
    source: str
    models: list[ModelOut]
    queue_length: int | None
    last_heartbeat: datetime | None
    heartbeat_age_s: float | None
    created_at: datetime
    updated_at: datetime
    dcgm_url: str
    has_api_key: bool  # the key itself is never returned
    kv_events: str  # vLLM's KV cache events endpoint, "" for none (routers subscribe)
    kv_events_replay: str
    # Its part in prefill/decode disaggregation (routing.pd): "prefill", "decode" or "both".
    role: str

    @staticmethod
    def resolve_has_api_key(obj: Worker) -> bool:
        return bool(obj.api_key)

    # The latest per-GPU readings (controlpanel.gpu) and where they came from ("nvml",
    # "dcgm"); an empty source means no GPU source reports.
    gpus_source: str
    gpus_at: datetime | None
    gpus: list[dict[str, Any]]
    gpu_warnings: list[str]

    @staticmethod
    def resolve_heartbeat_age_s(obj: Worker) -> float | None:
        age = obj.heartbeat_age(timezone.now())
        return None if age is None else round(age, 3)

    @staticmethod
    def resolve_gpu_warnings(obj: Worker) -> list[str]:
        return [w["message"] for w in obj.gpu_warnings]

    # Pool preflight (controlpanel.fleet.preflight): how this worker differs from the rest of
    # each of its models' pools, what an operator accepted, and the models refusing it.
    preflight: dict[str, Any]

    @staticmethod
    def resolve_preflight(obj: Worker) -> dict[str, Any]:
        found = (obj.preflight or {}).get("mismatches", {})
        return {
            "mismatches": {
                model: [{**x, "text": preflight.describe(x)} for x in xs]
                for model, xs in found.items()
            },
            "unaccepted": sorted(preflight.unaccepted(obj)),
            "accepted": obj.preflight_accepted or [],
            "refused_by": sorted(preflight.refused_models(obj, preflight.preflight_modes())),
            "facts": {k: v for k, v in (obj.pool_facts or {}).items() if k != "models_key"},
            "checked_at": (obj.preflight or {}).get("checked_at"),
        }


class WorkerIn(StrictIn):
    url: str = Field(max_length=MAX_URL)
    name: str = Field(default="", max_length=MAX_WORKER_NAME)
    # A DCGM exporter's metrics URL, e.g. http://gpu-1:9400/metrics
    dcgm_url: str = Field(default="", max_length=MAX_URL)
    # The key the vLLM server was started with (--api-key); sent upstream, never shown.
    api_key: str = Field(default="", max_length=512)
    # vLLM's KV cache events (--kv-events-config), as routers reach them: tcp://host:port.
    # Left out (or null): read from the worker's GET /kv_event_sources; "": none.
    kv_events: str | None = Field(default=None, max_length=512)
    kv_events_replay: str | None = Field(default=None, max_length=512)
    # Prefill/decode disaggregation: a model with "prefill" workers is disaggregated.
    role: Role = "both"


class WorkerPatch(StrictIn):
    name: str | None = Field(default=None, max_length=MAX_WORKER_NAME)
    weight: float | None = None
    dcgm_url: str | None = Field(default=None, max_length=MAX_URL)  # "" removes it
    reset_gpu_count: bool = False
    api_key: str | None = Field(default=None, max_length=512)  # "" removes it
    kv_events: str | None = Field(default=None, max_length=512)  # "" removes it
    kv_events_replay: str | None = Field(default=None, max_length=512)  # "" removes it
    role: Role | None = None


class LoraIn(StrictIn):
    lora_name: str = Field(min_length=1, max_length=300)
    lora_path: str = Field(min_length=1, max_length=1000)


@router.get("/workers", response=list[WorkerOut], auth=ADMIN_AUTH, tags=["workers"])
def workers_list(request: HttpRequest) -> Any:
    return list(Worker.objects.all())  # evaluated here: an outage is a 503, not a 500


@router.post("/workers", response={201: WorkerOut}, auth=ADMIN_AUTH, tags=["workers"])
def workers_add(request: HttpRequest, payload: WorkerIn) -> Any:
    worker = services.worker_add(
        url=payload.url,
        name=payload.name,
        dcgm_url=payload.dcgm_url,
        api_key=payload.api_key,
        kv_events=payload.kv_events,
        kv_events_replay=payload.kv_events_replay,
        role=payload.role,
        actor=request_actor(request),
    )
    return 201, worker


@router.get("/workers/{int:worker_id}", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"])
def workers_get(request: HttpRequest, worker_id: int) -> Any:
    return Worker.objects.get(pk=worker_id)


@router.post(
    "/workers/{int:worker_id}/drain", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"]
)
def workers_drain(request: HttpRequest, worker_id: int, force: bool = False) -> Any:
    """Draining a model's last routable worker is a 409 naming the models, unless ?force=1."""
    return services.worker_drain(
        worker_id=worker_id, actor=request_actor(request), refuse_last=not force
    )


@router.post(
    "/workers/{int:worker_id}/activate", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"]
)
def workers_activate(request: HttpRequest, worker_id: int) -> Any:
    return services.worker_activate(worker_id=worker_id, actor=request_actor(request))


@router.patch("/workers/{int:worker_id}", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"])
def workers_update(request: HttpRequest, worker_id: int, payload: WorkerPatch) -> Any:
    return services.worker_update(
        worker_id=worker_id,
        name=payload.name,
        weight=payload.weight,
        dcgm_url=payload.dcgm_url,
        reset_gpu_count=payload.reset_gpu_count,
        api_key=payload.api_key,
        kv_events=payload.kv_events,
        kv_events_replay=payload.kv_events_replay,
        role=payload.role,
        actor=request_actor(request),
    )


@router.delete("/workers/{int:worker_id}", response={204: None}, auth=ADMIN_AUTH, tags=["workers"])
def workers_remove(request: HttpRequest, worker_id: int, force: bool = False) -> Any:
    """Removing a model's last routable worker is a 409 naming the models, unless ?force=1."""
    services.worker_remove(worker_id=worker_id, actor=request_actor(request), refuse_last=not force)
    return 204, None


@router.post(
    "/workers/{int:worker_id}/loras", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"]
)
def workers_load_lora(request: HttpRequest, worker_id: int, payload: LoraIn) -> Any:
    """Load a LoRA adapter into the worker (vLLM's /v1/load_lora_adapter, which the public
    router never forwards); the router routes it once the worker lists it."""
    return loras.worker_load_lora(
        worker_id=worker_id, name=payload.lora_name, path=payload.lora_path,
        actor=request_actor(request),
    )  # fmt: skip


@router.delete(
    "/workers/{int:worker_id}/loras/{path:name}",
    response=WorkerOut,
    auth=ADMIN_AUTH,
    tags=["workers"],
)
def workers_unload_lora(request: HttpRequest, worker_id: int, name: str) -> Any:
    return loras.worker_unload_lora(worker_id=worker_id, name=name, actor=request_actor(request))


@router.post(
    "/workers/{int:worker_id}/preflight/accept",
    response=WorkerOut,
    auth=ADMIN_AUTH,
    tags=["workers"],
)
def workers_accept_preflight(request: HttpRequest, worker_id: int) -> Any:
    """Accept the worker's current differences from its pools: a model with preflight
    "refuse" takes it back into rotation (a new difference refuses it again)."""
    return preflight.worker_preflight_accept(worker_id=worker_id, actor=request_actor(request))
