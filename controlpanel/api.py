"""The admin and worker-agent JSON API (django-ninja, docs at /api/docs). Thin: each
endpoint authenticates, calls one service and shapes the answer."""

from __future__ import annotations

import logging
import secrets
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Field, NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer
from ninja.security.session import SessionAuthIsStaff

from controlpanel import gpu, loras, selectors, services
from controlpanel.models import ServedModel, Worker
from routing.policies import POLICIES

log = logging.getLogger(__name__)

api = NinjaAPI(
    title="vLLM Control Panel API",
    version="1",
    description="Manage the workers behind the router. Admin calls take "
    "`Authorization: Bearer $CONTROLPANEL_ADMIN_TOKEN` or a staff session; agent calls take "
    "`Authorization: Bearer $CONTROLPANEL_WORKER_TOKEN`.",
    urls_namespace="api",
)


class _TokenBearer(HttpBearer):
    setting = ""

    def authenticate(self, request: HttpRequest, token: str) -> str | None:
        expected: str = getattr(settings, self.setting)
        if expected and secrets.compare_digest(token.encode(), expected.encode()):
            return self.setting
        return None


class AdminToken(_TokenBearer):
    setting = "CONTROLPANEL_ADMIN_TOKEN"


class WorkerToken(_TokenBearer):
    setting = "CONTROLPANEL_WORKER_TOKEN"


class StaffSession(SessionAuthIsStaff):
    """A logged-in staff browser; CSRF is checked only when a session cookie is present,
    so a caller with no credentials at all gets a 401 that says what to send, not a 403."""

    def _get_key(self, request: HttpRequest) -> str | None:
        if self.param_name not in request.COOKIES:
            return None
        return super()._get_key(request)


ADMIN_AUTH: list[Any] = [AdminToken(), StaffSession()]
AGENT_AUTH = [WorkerToken()]


def _actor(request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.get_username()}"
    return "admin-token"


# --- errors in the OpenAI shape, like the router's ------------------------------------------


def _error(request: HttpRequest, status: int, message: str, kind: str) -> HttpResponse:
    return api.create_response(
        request,
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status,
    )


@api.exception_handler(services.ServiceError)
def _service_error(request: HttpRequest, exc: services.ServiceError) -> HttpResponse:
    return _error(request, exc.status, str(exc), type(exc).__name__)


@api.exception_handler(Worker.DoesNotExist)
def _no_worker(request: HttpRequest, exc: Exception) -> HttpResponse:
    return _error(request, 404, "no such worker; register again", "NotFoundError")


@api.exception_handler(ServedModel.DoesNotExist)
def _no_model(request: HttpRequest, exc: Exception) -> HttpResponse:
    return _error(request, 404, "no such model", "NotFoundError")


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    details = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors
    )
    return _error(request, 422, f"invalid request: {details}", "ValidationError")


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _error(request, 401, _auth_hint(request), "AuthenticationError")


def _auth_hint(request: HttpRequest) -> str:
    """Say which credential this endpoint takes, and whether the server has one at all."""
    agent_call = request.path.endswith(("/register", "/heartbeat", "/deregister"))
    setting = "CONTROLPANEL_WORKER_TOKEN" if agent_call else "CONTROLPANEL_ADMIN_TOKEN"
    if not getattr(settings, setting):
        if agent_call:
            return f"agent calls are disabled: the server has no {setting} set"
        return f"log in as staff (the server has no {setting} set for bearer access)"
    return f"missing or wrong credentials: send Authorization: Bearer ${setting}"


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    return _error(request, exc.status_code, str(exc), "HttpError")


@api.exception_handler(DatabaseError)
def _database_down(request: HttpRequest, exc: DatabaseError) -> HttpResponse:
    """The registry's database failed (down, out of connections, a lock): nothing was
    changed, and the caller may retry; the router keeps serving from its snapshot."""
    log.error("admin API %s %s: database error: %s", request.method, request.path, exc)
    response = _error(
        request, 503, "the control plane's database is unavailable; retry shortly", "DatabaseError"
    )
    response["Retry-After"] = "5"
    return response


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    """A bug: logged with its traceback, answered in the API's JSON error shape rather than
    Django's HTML page."""
    log.exception("admin API %s %s failed", request.method, request.path)
    return _error(request, 500, "internal error; see the server log", "InternalServerError")


# --- schemas ----------------------------------------------------------------------------

# Bounds of the columns input lands in: past them PostgreSQL refuses the write (a 500),
# where SQLite would have stored it. MAX_INT is PostgreSQL's integer, Django's IntegerField.
MAX_INT = 2**31 - 1
MAX_URL = Worker._meta.get_field("url").max_length
MAX_WORKER_NAME = Worker._meta.get_field("name").max_length


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


class WorkerIn(Schema):
    url: str = Field(max_length=MAX_URL)
    name: str = Field(default="", max_length=MAX_WORKER_NAME)
    # A DCGM exporter's metrics URL, e.g. http://gpu-1:9400/metrics
    dcgm_url: str = Field(default="", max_length=MAX_URL)
    # The key the vLLM server was started with (--api-key); sent upstream, never shown.
    api_key: str = Field(default="", max_length=512)


class WorkerPatch(Schema):
    name: str | None = Field(default=None, max_length=MAX_WORKER_NAME)
    weight: float | None = None
    dcgm_url: str | None = Field(default=None, max_length=MAX_URL)  # "" removes it
    reset_gpu_count: bool = False
    api_key: str | None = Field(default=None, max_length=512)  # "" removes it


class ServedModelOut(Schema):
    name: str
    policy: str
    policy_config: dict[str, Any]
    max_inflight: int
    workers: list[int]
    updated_at: datetime

    @staticmethod
    def resolve_workers(obj: ServedModel) -> list[int]:
        # Set by the endpoints from one query; a list of N models must not cost N scans.
        worker_ids: list[int] = getattr(obj, "worker_ids", [])
        return worker_ids


class ServedModelPatch(Schema):
    policy: str | None = None
    policy_config: dict[str, Any] | None = None
    # Requests in flight per router before new ones queue, then get 429; 0: no limit.
    max_inflight: int | None = Field(default=None, ge=0, le=1_000_000)


class RegisterIn(Schema):
    url: str = Field(max_length=MAX_URL)
    name: str = Field(default="", max_length=MAX_WORKER_NAME)
    # None: leave it as the operator set it
    dcgm_url: str | None = Field(default=None, max_length=MAX_URL)
    # Bare names or vLLM /v1/models entries; absent means "ask the server itself".
    models: list[str | dict[str, Any]] | None = None
    # The server's --api-key, for the router, probes and LoRA calls; None leaves it as set.
    api_key: str | None = Field(default=None, max_length=512)


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


# --- admin endpoints ----------------------------------------------------------------------


@api.get("/workers", response=list[WorkerOut], auth=ADMIN_AUTH, tags=["workers"])
def workers_list(request: HttpRequest) -> Any:
    return Worker.objects.all()


@api.post("/workers", response={201: WorkerOut}, auth=ADMIN_AUTH, tags=["workers"])
def workers_add(request: HttpRequest, payload: WorkerIn) -> Any:
    worker = services.worker_add(
        url=payload.url,
        name=payload.name,
        dcgm_url=payload.dcgm_url,
        api_key=payload.api_key,
        actor=_actor(request),
    )
    return 201, worker


@api.get("/workers/{int:worker_id}", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"])
def workers_get(request: HttpRequest, worker_id: int) -> Any:
    return Worker.objects.get(pk=worker_id)


@api.post("/workers/{int:worker_id}/drain", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"])
def workers_drain(request: HttpRequest, worker_id: int) -> Any:
    return services.worker_drain(worker_id=worker_id, actor=_actor(request))


@api.post(
    "/workers/{int:worker_id}/activate", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"]
)
def workers_activate(request: HttpRequest, worker_id: int) -> Any:
    return services.worker_activate(worker_id=worker_id, actor=_actor(request))


@api.patch("/workers/{int:worker_id}", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"])
def workers_update(request: HttpRequest, worker_id: int, payload: WorkerPatch) -> Any:
    return services.worker_update(
        worker_id=worker_id,
        name=payload.name,
        weight=payload.weight,
        dcgm_url=payload.dcgm_url,
        reset_gpu_count=payload.reset_gpu_count,
        api_key=payload.api_key,
        actor=_actor(request),
    )


@api.get("/models", response=list[ServedModelOut], auth=ADMIN_AUTH, tags=["models"])
def models_list(request: HttpRequest) -> Any:
    return _with_workers(list(ServedModel.objects.all()))


def _with_workers(models: list[ServedModel]) -> list[ServedModel]:
    serving = selectors.workers_by_model()
    for model in models:
        model.worker_ids = serving.get(model.name, [])  # type: ignore[attr-defined]
    return models


@api.get("/models/{path:name}", response=ServedModelOut, auth=ADMIN_AUTH, tags=["models"])
def models_get(request: HttpRequest, name: str) -> Any:
    return _with_workers([ServedModel.objects.get(name=name)])[0]


@api.patch("/models/{path:name}", response=ServedModelOut, auth=ADMIN_AUTH, tags=["models"])
def models_set_policy(request: HttpRequest, name: str, payload: ServedModelPatch) -> Any:
    """Choose the balancing policy of one model (names: see GET /api/policies) and/or its
    in-flight limit (`max_inflight`, 0: none)."""
    if payload.policy is None and payload.max_inflight is None:
        raise HttpError(422, "send `policy` (with `policy_config`) and/or `max_inflight`")
    model = ServedModel.objects.get(name=name)
    if payload.policy is not None:
        model = services.served_model_set_policy(
            name=name, policy=payload.policy, policy_config=payload.policy_config,
            actor=_actor(request),
        )  # fmt: skip
    if payload.max_inflight is not None:
        model = services.served_model_set_limit(
            name=name, max_inflight=payload.max_inflight, actor=_actor(request)
        )
    return _with_workers([model])[0]


@api.get("/policies", response=list[str], auth=ADMIN_AUTH, tags=["models"])
def policies_list(request: HttpRequest) -> Any:
    return sorted(POLICIES)


@api.delete("/workers/{int:worker_id}", response={204: None}, auth=ADMIN_AUTH, tags=["workers"])
def workers_remove(request: HttpRequest, worker_id: int) -> Any:
    services.worker_remove(worker_id=worker_id, actor=_actor(request))
    return 204, None


# --- agent endpoints ----------------------------------------------------------------------


@api.post("/workers/register", response=RegisterOut, auth=AGENT_AUTH, tags=["agent"])
def workers_register(request: HttpRequest, payload: RegisterIn) -> Any:
    worker = services.worker_register(
        url=payload.url,
        models=payload.models,
        name=payload.name,
        dcgm_url=payload.dcgm_url,
        api_key=payload.api_key,
    )
    return {"id": worker.pk, "heartbeat_interval": settings.CONTROLPANEL_HEARTBEAT_INTERVAL}


@api.post(
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


@api.post(
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


class LoraIn(Schema):
    lora_name: str = Field(min_length=1, max_length=300)
    lora_path: str = Field(min_length=1, max_length=1000)


@api.post("/workers/{int:worker_id}/loras", response=WorkerOut, auth=ADMIN_AUTH, tags=["workers"])
def workers_load_lora(request: HttpRequest, worker_id: int, payload: LoraIn) -> Any:
    """Load a LoRA adapter into the worker (vLLM's /v1/load_lora_adapter, which the public
    router never forwards); the router routes it once the worker lists it."""
    return loras.worker_load_lora(
        worker_id=worker_id, name=payload.lora_name, path=payload.lora_path,
        actor=_actor(request),
    )  # fmt: skip


@api.delete(
    "/workers/{int:worker_id}/loras/{path:name}",
    response=WorkerOut,
    auth=ADMIN_AUTH,
    tags=["workers"],
)
def workers_unload_lora(request: HttpRequest, worker_id: int, name: str) -> Any:
    return loras.worker_unload_lora(worker_id=worker_id, name=name, actor=_actor(request))


# Aliases and rollouts live in their own module; imported last, since it uses this one.
from controlpanel.api_rollouts import router as _rollouts_router  # noqa: E402

api.add_router("", _rollouts_router)

# Client keys and their usage, likewise.
from controlpanel.api_keys import router as _keys_router  # noqa: E402

api.add_router("", _keys_router)
