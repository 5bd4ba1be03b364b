"""Endpoints for worker agents: register, heartbeat (with NVML readings), deregister."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.errors import HttpError

from controlpanel.api.auth import AGENT_AUTH
from controlpanel.api.limits import MAX_INT, MAX_URL, MAX_WORKER_NAME
from controlpanel.fleet import gpu, services

router = Router()


class RegisterIn(Schema):
    url: str = Field(max_length=MAX_URL)
    name: str = Field(default="", max_length=MAX_WORKER_NAME)
    # None: leave it as the operator set it
    dcgm_url: str | None = Field(default=None, max_length=MAX_URL)
    # Bare names or vLLM /v1/models entries; absent means "ask the server itself".
    models: list[str | dict[str, Any]] | None = None
    # The server's --api-key, for the router, probes and LoRA calls; None leaves it as set.
    api_key: str | None = Field(default=None, max_length=512)
    # vLLM's KV cache events endpoints (tcp://host:port); None leaves them as set.
    kv_events: str | None = Field(default=None, max_length=512)
    kv_events_replay: str | None = Field(default=None, max_length=512)
    # "prefill", "decode" or "both" (routing.pd); None leaves it as set ("both" for a new one).
    role: str | None = Field(default=None, max_length=16)


class RegisterOut(Schema):
    id: int
    heartbeat_interval: int


class GpuIn(Schema):
    """One GPU as the agent reads it through NVML (see controlpanel.gpu for units)."""

    index: int = Field(ge=0, lt=1024)
    uuid: str | None = Field(default=None, max_length=gpu.MAX_TEXT)
    name: str | None = Field(default=None, max_length=gpu.MAX_TEXT)
    util: float | None = Field(default=None, ge=0, le=1)
    mem_used: float | None = Field(default=None, ge=0)  # bytes
    mem_total: float | None = Field(default=None, ge=0)
    temp: float | None = Field(default=None, ge=0, le=250)
    power: float | None = Field(default=None, ge=0)
    power_limit: float | None = Field(default=None, ge=0)
    ecc_errors: int | None = Field(default=None, ge=0)
    xid: int | None = Field(default=None, ge=0)


class HeartbeatIn(Schema):
    queue_length: int | None = Field(default=None, le=MAX_INT)
    # Absent when the agent has no GPU to report (no NVML); never a list of zeros.
    gpus: list[GpuIn] | None = Field(default=None, max_length=gpu.MAX_GPUS)


class HeartbeatOut(Schema):
    id: int
    state: str
    heartbeat_interval: int


@router.post("/workers/register", response=RegisterOut, auth=AGENT_AUTH, tags=["agent"])
def workers_register(request: HttpRequest, payload: RegisterIn) -> Any:
    worker = services.worker_register(
        url=payload.url,
        models=payload.models,
        name=payload.name,
        dcgm_url=payload.dcgm_url,
        api_key=payload.api_key,
        kv_events=payload.kv_events,
        kv_events_replay=payload.kv_events_replay,
        role=payload.role,
    )
    return {"id": worker.pk, "heartbeat_interval": settings.CONTROLPANEL_HEARTBEAT_INTERVAL}


@router.post(
    "/workers/{int:worker_id}/heartbeat", response=HeartbeatOut, auth=AGENT_AUTH, tags=["agent"]
)
def workers_heartbeat(request: HttpRequest, worker_id: int, payload: HeartbeatIn) -> Any:
    if payload.queue_length is not None and payload.queue_length < 0:
        raise HttpError(422, "queue_length cannot be negative")
    gpus = None if payload.gpus is None else [g.model_dump() for g in payload.gpus]
    worker = services.worker_heartbeat(
        worker_id=worker_id, queue_length=payload.queue_length, gpus=gpus
    )
    return {
        "id": worker.pk,
        "state": worker.state,
        "heartbeat_interval": settings.CONTROLPANEL_HEARTBEAT_INTERVAL,
    }


@router.post(
    "/workers/{int:worker_id}/deregister", response=HeartbeatOut, auth=AGENT_AUTH, tags=["agent"]
)
def workers_deregister(request: HttpRequest, worker_id: int) -> Any:
    """An agent whose server is shutting down drains it, so no new request is lost."""
    worker = services.worker_drain(worker_id=worker_id, actor="agent")
    return {
        "id": worker.pk,
        "state": worker.state,
        "heartbeat_interval": settings.CONTROLPANEL_HEARTBEAT_INTERVAL,
    }
