"""A worker's upstream key, GPU telemetry fields and role, as the worker services set them:
checked, applied to the row, and recorded in the audit trail (never the key itself)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from controlpanel.fleet import gpu, gpu_health
from controlpanel.fleet.errors import InvalidWorkerKey, InvalidWorkerRole, InvalidWorkerURL
from controlpanel.registry.choices import EventKind, WorkerRole
from controlpanel.registry.events import event_record
from controlpanel.registry.models import Worker


def key_note(worker: Worker) -> str:
    return " and an upstream API key" if worker.api_key else ""


def worker_key_event(worker: Worker, new_key: str, actor: str) -> None:
    """The audit trail says that a worker's upstream key changed, never what it is."""
    what = "removed" if not new_key else "rotated" if worker.api_key else "set"
    event_record(
        kind=EventKind.WORKER_KEY_CHANGED,
        worker=worker,
        message=f"upstream API key {what}",
        actor=actor,
        data={"change": what, "before": {"api_key": "set" if worker.api_key else "not set"},
              "after": {"api_key": what}},
    )  # fmt: skip


def api_key(key: str) -> str:
    """A worker key goes into an HTTP header: printable ASCII without spaces, or nothing."""
    key = key.strip()
    if len(key) > 512 or not all("!" <= ch <= "~" for ch in key):
        raise InvalidWorkerKey("a worker API key is up to 512 printable ASCII characters")
    return key


def role_note(worker: Worker) -> str:
    return "" if worker.role == WorkerRole.BOTH else f" as a {worker.role} worker"


def role(value: str) -> str:
    """Its part in prefill/decode disaggregation (routing.pd): "prefill", "decode" or "both"."""
    if value not in WorkerRole.values:
        known = ", ".join(f'"{r}"' for r in WorkerRole.values)
        raise InvalidWorkerRole(f"a worker's role is one of {known}, not {value!r}")
    return str(WorkerRole(value).value)


def dcgm_url(url: str) -> str:
    try:
        return gpu.normalize_dcgm_url(url)
    except ValueError as exc:
        raise InvalidWorkerURL(str(exc)) from exc


def dcgm_url_set(worker: Worker, url: str) -> list[str]:
    """A new exporter may see other GPUs: start from "unknown" rather than compare them.
    Returns the fields changed."""
    worker.dcgm_url = url
    forget = gpu_health.gpu_forget()
    for name, value in forget.items():
        setattr(worker, name, value)
    return ["dcgm_url", *forget]


def record_nvml(worker: Worker, raw: list[Any], *, now: datetime) -> list[str]:
    """Apply the agent's NVML readings (unless the worker's DCGM exporter has fresh ones);
    returns the fields changed."""
    readings = gpu.clean_gpus(raw) or []
    change = gpu_health.gpu_change(worker, gpus=readings, source=gpu_health.NVML, now=now)
    for name, value in change.fields.items():
        setattr(worker, name, value)
    for kind, message in change.events:
        event_record(kind=kind, worker=worker, message=message, actor="agent")
    return list(change.fields)
