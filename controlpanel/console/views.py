"""Server-rendered pages for operators (staff only). Thin: read through dashboard.py,
act through services, redirect back, and let the live feed tell every other browser."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlpanel.console import (
    charts,
    dashboard,
    event_log,
    fallback_views,
    gpu_dashboard,
    pool_views,
    problems,
    timefmt,
)
from controlpanel.fleet import served_models, services
from controlpanel.registry import errors
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.choices import WorkerRole, WorkerState
from controlpanel.registry.models import Alias, Event, ServedModel, Worker
from controlpanel.routers.reports import model_classes, worker_kv_streams
from routing.policies import POLICIES


@staff_member_required
def fleet(request: HttpRequest) -> HttpResponse:
    rows = dashboard.fleet_rows()
    context = {
        "rows": rows,
        "totals": dashboard.model_totals(rows),
        "problems": problems.fleet_problems(rows),
        "model_names": sorted({e["id"] for row in rows for e in row.worker.models}),
        "states": WorkerState.values,
        "roles": WorkerRole.values,
        "router_url": request.build_absolute_uri("/v1"),
        "form": request.session.pop("add_worker_form", {}),
    }
    return render(request, "controlpanel/fleet.html", context)


@staff_member_required
def worker_detail(request: HttpRequest, worker_id: int) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    window = charts.window_for(request.GET.get("range"))
    history = charts.worker_history(worker, window)
    context = {
        "worker": worker,
        "row": dashboard.fleet_rows(Worker.objects.filter(pk=worker_id))[0],
        "charts": charts.worker_charts(history, window),
        "gpu_charts": gpu_dashboard.gpu_charts(history, window),
        "events": Event.objects.filter(worker=worker).select_related("worker")[:30],
        "pool_differences": pool_views.worker_differences(worker),
        "kv_streams": worker_kv_streams(worker_id=worker.pk),
        "kv_form": request.session.pop("kv_events_form", None),
        **charts.window_context(window),
        # The page redraws its charts from new history about once a probe.
        "chart_refresh_ms": int(max(settings.CONTROLPANEL_PROBE_INTERVAL, 2.0) * 1000),
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
    # An alias is a name clients use, not a model a worker serves: it has its own page.
    for alias in Alias.objects.values_list("name", flat=True):
        cards.pop(alias, None)
    typed = request.session.pop("policy_form", {})
    for card in cards.values():
        card["typed"] = typed if typed.get("model") == card["name"] else None
        config = served[card["name"]].policy_config if card["name"] in served else {}
        card["policy_config"], card["policy_config_json"] = config, json.dumps(config)
        card["routable"] = sum(r.routable for r in card["rows"])
        card["inflight"] = sum(r.inflight for r in card["rows"])
        rates = [r.metrics.get("rps") for r in card["rows"] if r.metrics.get("rps") is not None]
        card["rps"] = sum(rates) if rates else None
        card["roles"] = dashboard.role_counts([r.worker for r in card["rows"]])
        # Disaggregated (routing.pd): its short prompts skip the prefill leg.
        split = any(r.worker.role == WorkerRole.PREFILL for r in card["rows"])
        model = served.get(card["name"])
        card["pd_bypass_tokens"] = (model.pd_bypass_tokens if model else 256) if split else None
    differences = pool_views.pool_differences([r.worker for r in rows])
    decisions = pool_views.recent_decisions()
    classes = model_classes()
    for card in cards.values():
        card["preflight"] = served[card["name"]].preflight if card["name"] in served else "warn"
        card["differences"] = differences.get(card["name"], [])
        refused = {d["worker"].pk for d in card["differences"] if d["refused"]}
        card["routable"] = sum(r.routable and r.worker.pk not in refused for r in card["rows"])
        card["decisions"] = decisions.get(card["name"], [])
        card["classes"] = classes.get(card["name"])
    typed_fallbacks = fallback_views.typed_form(request)
    configured = fallback_views.model_fallbacks(typed_fallbacks)
    for card in cards.values():
        card["fallbacks"] = configured.get(card["name"], {"fallbacks": [], "typed": None})
    context = {
        "models": sorted(cards.values(), key=lambda c: c["name"]),
        "aliases": fallback_views.alias_rows(typed_fallbacks),
        "policies": sorted(POLICIES),
        "knobs": {name: served_models.policy_knobs(name) for name in POLICIES},
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
        served_models.served_model_set_policy(
            name=name, policy=policy, policy_config=config, actor=request_actor(request)
        )
    except (ValueError, errors.ServiceError) as exc:
        messages.error(request, f"Policy of {name} not changed: {exc}")
        request.session["policy_form"] = {
            "model": name, "policy": policy, "policy_config": request.POST.get("policy_config", "")
        }  # fmt: skip
    except ServedModel.DoesNotExist:
        messages.error(request, f"No model named {name}.")
    else:
        messages.success(request, f"{name} is now balanced with {policy}.")
    return redirect("models")


@staff_member_required
def events_page(request: HttpRequest) -> HttpResponse:
    """The event log, filtered by the query string (console.event_log). With `partial=1`
    only the rows, for the live page fetching what is newer than it has (`after`)."""
    filters = event_log.event_filters(request.GET)
    events = list(event_log.events_query(filters)[: event_log.PAGE_SIZE])
    if request.GET.get("partial") == "1":
        return render(request, "controlpanel/_event_rows.html", {"events": events})
    for error in filters.errors:
        messages.error(request, error)
    query = request.GET.copy()
    for name in ("after", "partial", "before"):
        query.pop(name, None)
    older = query.copy()
    if len(events) == event_log.PAGE_SIZE:
        older["before"] = str(events[-1].pk)
    context = {
        "events": events,
        "filters": filters,
        "query": query.urlencode(),
        # A page further back is history: it does not take new events on top.
        "live_events": filters.before is None,
        "older": older.urlencode() if "before" in older else "",
        "latest": event_log.latest_event_id(),
        "page_size": event_log.PAGE_SIZE,
        "workers": Worker.objects.order_by("name"),
        "kinds": event_log.kinds(also=filters.kinds),
        "actors": event_log.actors(),
        "severities": event_log.SEVERITIES,
        "since_choices": list(event_log.SINCE_LABELS.items()),
        "zone": timefmt.zone_name(),
    }
    return render(request, "controlpanel/events.html", context)


@staff_member_required
@require_POST
def worker_add(request: HttpRequest) -> HttpResponse:
    url, name = request.POST.get("url", ""), request.POST.get("name", "").strip()
    dcgm_url, api_key = request.POST.get("dcgm_url", ""), request.POST.get("api_key", "")
    kv_events = request.POST.get("kv_events", "").strip()
    role = request.POST.get("role", WorkerRole.BOTH)
    try:
        worker = services.worker_add(
            url=url, name=name, dcgm_url=dcgm_url, api_key=api_key, role=role,
            # left blank: read from the worker (vLLM's /kv_event_sources), as the API does
            kv_events=kv_events or None, actor=request_actor(request),
        )  # fmt: skip
    except errors.ServiceError as exc:
        messages.error(request, f"Could not add {url}: {exc}")
        # What was typed comes back in the form (the key never: it is a secret).
        typed = {"url": url, "name": name, "dcgm_url": dcgm_url, "kv_events": kv_events,
                 "role": role}  # fmt: skip
        request.session["add_worker_form"] = typed
    else:
        found = ", ".join(worker.model_ids)
        kv = f" KV events: {worker.kv_events}." if worker.kv_events else ""
        role_note = f" Role: {worker.role}." if worker.role != WorkerRole.BOTH else ""
        messages.success(request, f"Added {worker.name}, serving {found}.{role_note}{kv}")
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
            reset_gpu_count=reset, actor=request_actor(request),
        )  # fmt: skip
    except errors.ServiceError as exc:
        messages.error(request, f"GPU source not changed: {exc}")
    else:
        messages.success(request, "GPU count accepted." if reset else "GPU source saved.")
    return redirect("worker", worker_id=worker.pk)


@staff_member_required
@require_POST
def worker_kv_events(request: HttpRequest, worker_id: int) -> HttpResponse:
    """Set, change or clear (both empty) the worker's KV cache events endpoints."""
    worker = get_object_or_404(Worker, pk=worker_id)
    stream = request.POST.get("kv_events", "").strip()
    replay = request.POST.get("kv_events_replay", "").strip()
    try:
        services.worker_update(
            worker_id=worker.pk, name=None, weight=None, kv_events=stream,
            kv_events_replay=replay, actor=request_actor(request),
        )  # fmt: skip
    except errors.ServiceError as exc:
        messages.error(request, f"KV events endpoints not changed: {exc}")
        request.session["kv_events_form"] = {"kv_events": stream, "kv_events_replay": replay}
    else:
        saved = "KV events endpoints saved" if stream else "KV events endpoints removed"
        messages.success(request, f"{saved}; every router follows within a second.")
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
            worker_id=worker.pk, name=None, weight=None, api_key=key, actor=request_actor(request)
        )
    except errors.ServiceError as exc:
        messages.error(request, f"API key not changed: {exc}")
    else:
        messages.success(request, "API key saved." if key else "API key removed.")
    return redirect("worker", worker_id=worker.pk)


def _worker_action(request: HttpRequest, worker_id: int, action: str) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    try:
        _act(request, worker, action, confirmed=request.POST.get("force") == "1")
    except errors.ServiceError as exc:
        messages.error(request, f"{worker.name} not changed: {exc}")
    return redirect("fleet")


def _act(request: HttpRequest, worker: Worker, action: str, *, confirmed: bool) -> None:
    """`confirmed`: the operator said yes to the page's question about a model's last
    routable worker; without it the service refuses to take that worker out."""
    actor = request_actor(request)
    if action == "drain":
        services.worker_drain(worker_id=worker.pk, actor=actor, refuse_last=not confirmed)
        messages.info(request, f"Draining {worker.name}: no new requests; in-flight ones finish.")
    elif action == "activate":
        services.worker_activate(worker_id=worker.pk, actor=actor)
        messages.success(request, f"{worker.name} is active again.")
    else:
        services.worker_remove(worker_id=worker.pk, actor=actor, refuse_last=not confirmed)
        messages.success(request, f"Removed {worker.name}.")


@staff_member_required
@require_POST
def workers_bulk(request: HttpRequest) -> HttpResponse:
    """Drain or activate the selected workers. A bulk drain never takes a model's last
    routable worker: that one is refused with its reason, to be drained from its own row."""
    action = request.POST.get("action", "")
    # ASCII digits that fit a key: "²" passes isdigit() but not int(), 30 digits no column.
    ids = [int(v) for v in request.POST.getlist("worker") if v.isascii() and v.isdigit()
           and len(v) < 19]  # fmt: skip
    if action not in ("drain", "activate") or not ids:
        messages.error(request, "Select at least one worker, then Drain or Activate.")
        return redirect("fleet")
    for worker in Worker.objects.filter(pk__in=ids):
        try:
            _act(request, worker, action, confirmed=False)
        except errors.ServiceError as exc:
            messages.error(request, f"{worker.name} not changed: {exc}")
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
