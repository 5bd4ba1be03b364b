"""The rollouts pages: aliases, plans, the create form and the admin actions (staff only).
Like views.py: read through rollout_dashboard, act through controlpanel.rollouts."""

from __future__ import annotations

import re
from datetime import datetime

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlpanel import rollout_dashboard, rollouts, selectors
from controlpanel.models import Alias
from controlpanel.services import ServiceError
from controlpanel.views import _actor

DEFAULT_STEPS_TEXT = "5 10min\n25 10min\n50 10min\n100 0"
_UNITS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
_STEP_LINE = re.compile(r"^\s*(\d+)\s*%?\s+(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


@staff_member_required
def rollouts_page(request: HttpRequest) -> HttpResponse:
    context = {
        "aliases": rollout_dashboard.alias_rows(),
        "panels": [rollout_dashboard.panel(p) for p in rollout_dashboard.recent_plans()],
        "known_models": sorted(selectors.workers_by_model()),
        "default_steps": DEFAULT_STEPS_TEXT,
    }
    return render(request, "controlpanel/rollouts.html", context)


@staff_member_required
def rollout_detail(request: HttpRequest, plan_id: int) -> HttpResponse:
    try:
        plan = rollouts.rollout_get(plan_id)
    except rollouts.RolloutNotFound as exc:
        messages.error(request, str(exc))
        return redirect("rollouts")
    return render(request, "controlpanel/rollout.html", {"p": rollout_dashboard.panel(plan)})


@staff_member_required
@require_POST
def rollout_create(request: HttpRequest) -> HttpResponse:
    form = request.POST
    try:
        plan = rollouts.rollout_create(
            request=rollouts.PlanRequest(
                alias=form.get("alias", ""),
                from_target=form.get("from_target", "").strip() or None,
                to_target=form.get("to_target", "").strip(),
                steps=tuple(parse_steps(form.get("steps", ""))),
                start_at=_start_at(form.get("start_at", "")),
                max_error_rate=float(form.get("max_error_rate") or 2) / 100,
                max_ttft_p95_ratio=float(form.get("max_ttft_p95_ratio") or 1.5),
                min_requests=int(form.get("min_requests") or 50),
                drain_old=form.get("drain_old") == "1",
            ),
            actor=_actor(request),
        )
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Plan not created: {exc}")
        return redirect("rollouts")
    messages.success(request, f"Rollout #{plan.pk} is {plan.state}.")
    return redirect("rollout", plan_id=plan.pk)


def parse_steps(text: str) -> list[dict[str, float]]:
    """Lines like `25 10min`: the new target's % and the hold (s, min or h; bare: s)."""
    steps = []
    for number, line in enumerate(text.strip().splitlines(), start=1):
        if not line.strip():
            continue
        match = _STEP_LINE.match(line.lower())
        if not match or match.group(3) not in _UNITS:
            raise ValueError(f"step line {number} `{line.strip()}` is not like `25 10min`")
        weight, hold, unit = match.groups()
        steps.append({"weight": int(weight), "hold_seconds": float(hold) * _UNITS[unit]})
    return steps


def _start_at(text: str) -> datetime | None:
    if not text.strip():
        return None
    moment = datetime.fromisoformat(text.strip())
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


@staff_member_required
@require_POST
def rollout_action(request: HttpRequest, plan_id: int, action: str) -> HttpResponse:
    try:
        plan = rollouts.rollout_action(plan_id=plan_id, action=action, actor=_actor(request))
    except ServiceError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Rollout #{plan.pk}: {plan.reason}.")
    return redirect("rollout", plan_id=plan_id)


@staff_member_required
@require_POST
def alias_save(request: HttpRequest) -> HttpResponse:
    """Create an alias, or set an existing one's weights; `targets` reads `a=90, b=10`."""
    name = request.POST.get("name", "").strip()
    try:
        targets = parse_targets(request.POST.get("targets", ""))
        if Alias.objects.filter(name=name).exists():
            rollouts.alias_update(name=name, targets=targets, actor=_actor(request))
            messages.success(request, f"{name} now sends {rollouts.weights_text(targets)}.")
        else:
            description = request.POST.get("description", "")
            rollouts.alias_create(
                name=name, targets=targets, description=description, actor=_actor(request)
            )
            messages.success(request, f"Created {name}: {rollouts.weights_text(targets)}.")
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Alias {name} not saved: {exc}")
    return redirect("rollouts")


@staff_member_required
@require_POST
def alias_delete(request: HttpRequest) -> HttpResponse:
    name = request.POST.get("name", "")
    try:
        rollouts.alias_delete(name=name, actor=_actor(request))
    except ServiceError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Deleted the alias {name}.")
    return redirect("rollouts")


def parse_targets(text: str) -> dict[str, int]:
    targets: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.replace("\n", ",").split(","))):
        name, sep, weight = part.rpartition("=")
        if not sep or not name.strip() or not weight.strip().isdigit():
            raise ValueError(f"`{part}` is not like `model-name=90`")
        targets[name.strip()] = int(weight)
    return targets
