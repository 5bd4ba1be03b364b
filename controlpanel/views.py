"""Server-rendered pages for operators (staff only). Thin: read through dashboard.py,
act through services, redirect back, and let the live feed tell every other browser."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlpanel import dashboard, gpu_dashboard, services
from controlpanel.models import Event, EventKind, ServedModel, Worker
from routing.policies import POLICIES


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


@staff_member_required
def fleet(request: HttpRequest) -> HttpResponse:
    rows = dashboard.fleet_rows()
    context = {
        "rows": rows,
        "totals": dashboard.model_totals(rows),
        "router_url": request.build_absolute_uri("/v1"),
    }
    return render(request, "controlpanel/fleet.html", context)


@staff_member_required
def worker_detail(request: HttpRequest, worker_id: int) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    series = dashboard.chart_series(worker)
    titles = {
        "queue": "Queue (running + waiting)",
        "kv_cache": "KV-cache usage, %",
        "ttft": "Time to first token p50, ms",
        "rps": "Requests per second",
    }
    charts = [{"title": title, **series[name]} for name, title in titles.items()]
    context = {
        "worker": worker,
        "row": dashboard.fleet_rows(Worker.objects.filter(pk=worker_id))[0],
        "charts": charts,
        "gpu_charts": gpu_dashboard.gpu_charts(worker),
        "events": Event.objects.filter(worker=worker).select_related("worker")[:30],
    }
    return render(request, "controlpanel/worker.html", context)


@staff_member_required
def models_page(request: HttpRequest) -> HttpResponse:
    rows = dashboard.fleet_rows()
    served = {m.name: m for m in ServedModel.objects.all()}
    policies = {name: m.policy for name, m in served.items()}
    cards: dict[str, dict[str, Any]] = {}
    for row in rows:
        for entry in row.worker.models:
            card = cards.setdefault(
                entry["id"],
                {"name": entry["id"], "parent": entry.get("parent"), "rows": [],
                 "policy": policies.get(entry["id"], "shortest_queue")},
            )  # fmt: skip
            card["rows"].append(row)
    for name, policy in policies.items():
        cards.setdefault(name, {"name": name, "parent": None, "rows": [], "policy": policy})
    for card in cards.values():
        config = served[card["name"]].policy_config if card["name"] in served else {}
        card["policy_config"], card["policy_config_json"] = config, json.dumps(config)
        card["routable"] = sum(r.routable for r in card["rows"])
        card["inflight"] = sum(r.inflight for r in card["rows"])
        rates = [r.metrics.get("rps") for r in card["rows"] if r.metrics.get("rps") is not None]
        card["rps"] = sum(rates) if rates else None
    context = {
        "models": sorted(cards.values(), key=lambda c: c["name"]),
        "policies": sorted(POLICIES),
    }
    return render(request, "controlpanel/models.html", context)


@staff_member_required
@require_POST
def model_policy(request: HttpRequest) -> HttpResponse:
    name, policy = request.POST.get("model", ""), request.POST.get("policy", "")
    try:
        config = json.loads(request.POST.get("policy_config") or "{}")
        if not isinstance(config, dict):
            raise ValueError("the configuration must be a JSON object")
        services.served_model_set_policy(
            name=name, policy=policy, policy_config=config, actor=_actor(request)
        )
    except (ValueError, services.ServiceError) as exc:
        messages.error(request, f"Policy of {name} not changed: {exc}")
    except ServedModel.DoesNotExist:
        messages.error(request, f"No model named {name}.")
    else:
        messages.success(request, f"{name} is now balanced with {policy}.")
    return redirect("models")


@staff_member_required
def events_page(request: HttpRequest) -> HttpResponse:
    events = Event.objects.select_related("worker")
    worker = request.GET.get("worker", "")
    kind = request.GET.get("kind", "")
    if worker.isdigit():
        events = events.filter(worker_id=int(worker))
    if kind:
        events = events.filter(kind=kind)
    context = {
        "events": events[:200],
        "workers": Worker.objects.all(),
        "kinds": EventKind.choices,
        "selected_worker": int(worker) if worker.isdigit() else None,
        "selected_kind": kind,
    }
    return render(request, "controlpanel/events.html", context)


@staff_member_required
@require_POST
def worker_add(request: HttpRequest) -> HttpResponse:
    url, name = request.POST.get("url", ""), request.POST.get("name", "").strip()
    dcgm_url, api_key = request.POST.get("dcgm_url", ""), request.POST.get("api_key", "")
    try:
        worker = services.worker_add(
            url=url, name=name, dcgm_url=dcgm_url, api_key=api_key, actor=_actor(request)
        )
    except services.ServiceError as exc:
        messages.error(request, f"Could not add {url}: {exc}")
    else:
        found = ", ".join(worker.model_ids)
        messages.success(request, f"Added {worker.name}, serving {found}.")
    return redirect("fleet")


@staff_member_required
@require_POST
def worker_gpu_source(request: HttpRequest, worker_id: int) -> HttpResponse:
    """Set or clear the worker's DCGM exporter; or accept the GPU count it reports now."""
    worker = get_object_or_404(Worker, pk=worker_id)
    reset = request.POST.get("reset_gpu_count") == "1"
    dcgm_url = None if reset else request.POST.get("dcgm_url", "")
    try:
        services.worker_update(
            worker_id=worker.pk, name=None, weight=None, dcgm_url=dcgm_url,
            reset_gpu_count=reset, actor=_actor(request),
        )  # fmt: skip
    except services.ServiceError as exc:
        messages.error(request, f"GPU source not changed: {exc}")
    else:
        messages.success(request, "GPU count accepted." if reset else "GPU source saved.")
    return redirect("worker", worker_id=worker.pk)


@staff_member_required
@require_POST
def worker_api_key(request: HttpRequest, worker_id: int) -> HttpResponse:
    """Set, change or (with `clear`) remove the key the worker's vLLM requires."""
    worker = get_object_or_404(Worker, pk=worker_id)
    clearing = request.POST.get("clear") == "1"
    key = "" if clearing else request.POST.get("api_key", "").strip()
    if not key and not clearing:
        messages.info(request, "No key entered; nothing changed.")
        return redirect("worker", worker_id=worker.pk)
    try:
        services.worker_update(
            worker_id=worker.pk, name=None, weight=None, api_key=key, actor=_actor(request)
        )
    except services.ServiceError as exc:
        messages.error(request, f"API key not changed: {exc}")
    else:
        messages.success(request, "API key saved." if key else "API key removed.")
    return redirect("worker", worker_id=worker.pk)


def _worker_action(request: HttpRequest, worker_id: int, action: str) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    if action == "drain":
        services.worker_drain(worker_id=worker.pk, actor=_actor(request))
        messages.info(request, f"Draining {worker.name}: no new requests; in-flight ones finish.")
    elif action == "activate":
        services.worker_activate(worker_id=worker.pk, actor=_actor(request))
        messages.success(request, f"{worker.name} is active again.")
    else:
        services.worker_remove(worker_id=worker.pk, actor=_actor(request))
        messages.success(request, f"Removed {worker.name}.")
    return redirect("fleet")


@staff_member_required
@require_POST
def worker_drain(request: HttpRequest, worker_id: int) -> HttpResponse:
    return _worker_action(request, worker_id, "drain")


@staff_member_required
@require_POST
def worker_activate(request: HttpRequest, worker_id: int) -> HttpResponse:
    return _worker_action(request, worker_id, "activate")


@staff_member_required
@require_POST
def worker_remove(request: HttpRequest, worker_id: int) -> HttpResponse:
    return _worker_action(request, worker_id, "remove")
