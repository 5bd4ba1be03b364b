"""The operator's view of routing decisions and pool preflight: each model's recent
decisions (routing.telemetry.explain) and how its workers differ (controlpanel.fleet.preflight)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from controlpanel.fleet import preflight, served_models
from controlpanel.registry import errors
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.models import ServedModel, Worker
from routing.telemetry import explain


def recent_decisions() -> dict[str, list[dict[str, Any]]]:
    """Every model's latest decisions over the deployment's routers, from the router of
    this process (empty where none runs)."""
    return explain.on_router(lambda app: app.recent_decisions()) or {}


def pool_differences(workers: list[Worker]) -> dict[str, list[dict[str, Any]]]:
    """Per model: each worker unlike its pool, with its differences as the page shows them."""
    modes = preflight.preflight_modes()
    out: dict[str, list[dict[str, Any]]] = {}
    for worker in workers:
        open_ = preflight.unaccepted(worker)
        for model, found in (worker.preflight or {}).get("mismatches", {}).items():
            out.setdefault(model, []).append(
                {"worker": worker, "texts": [preflight.describe(x) for x in found],
                 "accepted": model not in open_,
                 "refused": model in open_ and modes.get(model) == "refuse"}
            )  # fmt: skip
    return out


def worker_differences(worker: Worker) -> list[dict[str, Any]]:
    """For the worker page: per model, its differences and whether they keep it out."""
    modes, open_ = preflight.preflight_modes(), preflight.unaccepted(worker)
    return [
        {"model": model, "texts": [preflight.describe(x) for x in found],
         "accepted": model not in open_, "refused": model in open_ and modes.get(model) == "refuse"}
        for model, found in (worker.preflight or {}).get("mismatches", {}).items()
    ]  # fmt: skip


@staff_member_required
@require_POST
def model_preflight(request: HttpRequest) -> HttpResponse:
    name, mode = request.POST.get("model", ""), request.POST.get("preflight", "")
    try:
        served_models.served_model_set_preflight(name=name, mode=mode, actor=request_actor(request))
    except errors.ServiceError as exc:
        messages.error(request, f"Preflight of {name} not changed: {exc}")
    except ServedModel.DoesNotExist:
        messages.error(request, f"No model named {name}.")
    else:
        messages.success(request, f"{name}: preflight {mode}.")
    return redirect("models")


@staff_member_required
@require_POST
def worker_preflight_accept(request: HttpRequest, worker_id: int) -> HttpResponse:
    try:
        worker = preflight.worker_preflight_accept(
            worker_id=worker_id, actor=request_actor(request)
        )
    except Worker.DoesNotExist:
        messages.error(request, "No such worker.")
        return redirect("fleet")
    messages.success(request, f"{worker.name}: its differences from the pool are accepted.")
    return redirect("worker", worker_id=worker_id)
