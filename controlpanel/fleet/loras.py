"""LoRA adapters loaded into and unloaded from a worker, by admins, through the control API.

vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` change what a server serves
for every client; the public router never forwards them (routing.routes PRIVATE_ROUTES and
the 404 for unknown paths). Here an admin asks the control plane, which calls the worker,
then re-reads its `/v1/models` so the router routes the adapter within a second.
"""

from __future__ import annotations

import httpx
from django.conf import settings
from django.db import transaction

from controlpanel.fleet.discovery import discover_models, model_keys
from controlpanel.fleet.probes import tls_context, worker_auth
from controlpanel.fleet.served_models import served_models_ensure
from controlpanel.registry.choices import EventKind
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.events import event_record
from controlpanel.registry.models import RoutingGeneration, Worker


class LoraRefused(ServiceError):
    """The worker refused the change; its own words are in the message."""

    status = 409


class LoraUnreachable(ServiceError):
    status = 424  # Failed Dependency: the control plane is fine, the worker is not there


def worker_load_lora(*, worker_id: int, name: str, path: str, actor: str) -> Worker:
    worker = Worker.objects.get(pk=worker_id)
    _call(worker, "load_lora_adapter", {"lora_name": name, "lora_path": path})
    return _refresh_models(worker, f"LoRA adapter {name} loaded from {path}", actor)


def worker_unload_lora(*, worker_id: int, name: str, actor: str) -> Worker:
    worker = Worker.objects.get(pk=worker_id)
    _call(worker, "unload_lora_adapter", {"lora_name": name})
    return _refresh_models(worker, f"LoRA adapter {name} unloaded", actor)


def _call(worker: Worker, endpoint: str, body: dict[str, str]) -> None:
    url = f"{worker.url}/v1/{endpoint}"
    try:
        response = httpx.post(
            url,
            json=body,
            headers=worker_auth(worker.api_key),
            timeout=settings.CONTROLPANEL_DISCOVERY_TIMEOUT,
            verify=tls_context(),
        )
    except httpx.HTTPError as exc:
        raise LoraUnreachable(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        raise LoraRefused(f"{worker.name} refused: HTTP {response.status_code} {_said(response)}")


def _said(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


def _refresh_models(worker: Worker, what: str, actor: str) -> Worker:
    entries = discover_models(url=worker.url, api_key=worker.api_key)
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker.pk)
        changed = model_keys(worker.models) != model_keys(entries)
        worker.models = entries
        worker.save(update_fields=["models", "updated_at"])
        served_models_ensure(entries)
        event_record(
            kind=EventKind.MODELS_CHANGED,
            worker=worker,
            message=f"{what}; models now {', '.join(e['id'] for e in entries)}"
            + ("" if changed else " (unchanged)"),
            actor=actor,
        )
        RoutingGeneration.bump()
    return worker
