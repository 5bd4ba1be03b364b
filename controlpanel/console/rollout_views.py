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

from controlpanel.console import rollout_dashboard
from controlpanel.fleet import selectors
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.models import Alias
from controlpanel.rollouts import aliases, plans, transitions

MAX_MIN_REQUESTS = 2**31 - 1  # RolloutPlan.min_requests is an integer
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
        "form": request.session.pop("plan_form", {}),
    }
    return render(request, "controlpanel/rollouts.html", context)


@staff_member_required
def rollout_detail(request: HttpRequest, plan_id: int) -> HttpResponse:
    try:
        plan = transitions.rollout_get(plan_id)
    except transitions.RolloutNotFound as exc:
        messages.error(request, str(exc))
        return redirect("rollouts")
    return render(request, "controlpanel/rollout.html", {"p": rollout_dashboard.panel(plan)})


_PLAN_FIELDS = (
    "alias", "from_target", "to_target", "steps", "start_at", "max_error_rate",
    "max_ttft_p95_ratio", "min_requests", "drain_old",
)  # fmt: skip


@staff_member_required
@require_POST
def rollout_create(request: HttpRequest) -> HttpResponse:
    form = request.POST
    try:
        plan = plans.rollout_create(
            request=plans.PlanRequest(
                alias=form.get("alias", ""),
                from_target=form.get("from_target", "").strip() or None,
                to_target=form.get("to_target", "").strip(),
                steps=tuple(parse_steps(form.get("steps", ""))),
                start_at=_start_at(form.get("start_at", "")),
                max_error_rate=float(form.get("max_error_rate") or 2) / 100,
                max_ttft_p95_ratio=float(form.get("max_ttft_p95_ratio") or 1.5),
                min_requests=_min_requests(form.get("min_requests", "")),
                drain_old=form.get("drain_old") == "1",
            ),
            actor=request_actor(request),
        )
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Plan not created: {exc}")
        # What was typed comes back in the form, steps and gates included.
        request.session["plan_form"] = {k: v for k, v in form.items() if k in _PLAN_FIELDS}
        return redirect("rollouts")
    # Not its state: the page below shows that live, and a flash would go stale.
    messages.success(request, f"Created rollout #{plan.pk}.")
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


def _min_requests(text: str) -> int:
    """The gate's request count, within its integer column (past it the write is a 500)."""
    count = int(text.strip() or 50)
    if count > MAX_MIN_REQUESTS:
        raise ValueError(f"min_requests is at most {MAX_MIN_REQUESTS}")
    return count


def _start_at(text: str) -> datetime | None:
    if not text.strip():
        return None
    moment = datetime.fromisoformat(text.strip())
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


@staff_member_required
@require_POST
def rollout_action(request: HttpRequest, plan_id: int, action: str) -> HttpResponse:
    try:
        plan = transitions.rollout_action(
            plan_id=plan_id, action=action, actor=request_actor(request)
        )
    except ServiceError as exc:
        messages.error(request, str(exc))
    else:
        # The state it is in now, as the badge says it, and why (unless that says no more).
        state = plan.state.replace("_", " ")
        why = "" if plan.reason.lower().startswith(state) else f": {plan.reason}"
        messages.success(request, f"Rollout #{plan.pk} is {state}{why}.")
    return redirect("rollout", plan_id=plan_id)


@staff_member_required
@require_POST
def alias_save(request: HttpRequest) -> HttpResponse:
    """Create an alias, or set an existing one's weights; `targets` reads `a=90, b=10`."""
    name = request.POST.get("name", "").strip()
    try:
        targets = parse_targets(request.POST.get("targets", ""))
        if Alias.objects.filter(name=name).exists():
            aliases.alias_update(name=name, targets=targets, actor=request_actor(request))
            messages.success(request, f"{name} now sends {aliases.weights_text(targets)}.")
        else:
            description = request.POST.get("description", "")
            aliases.alias_create(
                name=name, targets=targets, description=description, actor=request_actor(request)
            )
            messages.success(request, f"Created {name}: {aliases.weights_text(targets)}.")
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Alias {name} not saved: {exc}")
    return redirect("rollouts")


@staff_member_required
@require_POST
def alias_delete(request: HttpRequest) -> HttpResponse:
    name = request.POST.get("name", "")
    try:
        aliases.alias_delete(name=name, actor=request_actor(request))
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
