"""Creating rollout plans: their steps, their gates and the pre-flight checks that must pass
before a plan may start."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlpanel.registry.choices import RolloutState, WorkerState
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.models import ACTIVE_ROLLOUT_STATES, Alias, RolloutPlan, Worker
from controlpanel.rollouts.aliases import alias_locked
from controlpanel.rollouts.transitions import plan_event, start

S = RolloutState
WEEK = 7 * 86400
DEFAULT_STEPS = (
    {"weight": 5, "hold_seconds": 600},
    {"weight": 25, "hold_seconds": 600},
    {"weight": 50, "hold_seconds": 600},
    {"weight": 100, "hold_seconds": 0},
)


class InvalidPlan(ServiceError):
    status = 422


class PreflightFailed(ServiceError):
    status = 409

    def __init__(self, problems: list[str]) -> None:
        super().__init__("pre-flight checks failed: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class PlanRequest:
    alias: str
    to_target: str
    from_target: str | None = None
    steps: tuple[dict[str, Any], ...] = DEFAULT_STEPS
    start_at: datetime | None = None
    max_error_rate: float = 0.02
    max_ttft_p95_ratio: float = 1.5
    min_requests: int = 50
    drain_old: bool = False


def steps_clean(steps: Iterable[Any]) -> list[dict[str, Any]]:
    clean: list[dict[str, Any]] = []
    for raw in steps:
        weight, hold = raw.get("weight"), raw.get("hold_seconds", 0)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise InvalidPlan(
                "each step's weight is an integer from 1 to 100 (% to the new target)"
            )
        if (
            isinstance(hold, bool)
            or not isinstance(hold, int | float)
            or not 0 <= hold <= 7 * 86400
        ):
            raise InvalidPlan("each step's hold_seconds is a number from 0 to 604800")
        if clean and weight <= clean[-1]["weight"]:
            raise InvalidPlan("step weights must rise from one step to the next")
        clean.append({"weight": weight, "hold_seconds": float(hold)})
    if not clean:
        raise InvalidPlan("a plan needs at least one step")
    if clean[-1]["weight"] != 100:
        raise InvalidPlan("the last step must send 100% to the new target")
    return clean


def rollout_create(*, request: PlanRequest, actor: str) -> RolloutPlan:
    """Persist a plan; one without a start time (or one in the past) starts now, after its
    pre-flight checks, and is not kept when they fail."""
    steps = steps_clean(request.steps)
    _check_gates(request)
    starts_now = request.start_at is None or request.start_at <= timezone.now()
    with transaction.atomic():
        alias = alias_locked(request.alias)
        from_target = request.from_target or _sole_target(alias)
        if request.to_target == from_target:
            raise InvalidPlan("the new target must differ from the old one")
        if request.to_target == alias.name:
            raise InvalidPlan("an alias cannot be its own target")
        plan = RolloutPlan(
            alias=alias,
            from_target=from_target,
            to_target=request.to_target,
            steps=steps,
            start_at=request.start_at,
            max_error_rate=request.max_error_rate,
            max_ttft_p95_ratio=request.max_ttft_p95_ratio,
            min_requests=request.min_requests,
            drain_old=request.drain_old,
            created_by=actor,
            reason="created" if starts_now else "scheduled",
        )
        if starts_now and (problems := preflight(plan)):
            raise PreflightFailed(problems)
        plan.save()
        start_at = request.start_at
        when = "to start now" if starts_now or start_at is None else f"for {start_at.isoformat()}"
        plan_event(plan, None, S.SCHEDULED, f"created {when}", actor)
    return start(plan, actor) if starts_now else plan


def _check_gates(request: PlanRequest) -> None:
    if not 0 <= request.max_error_rate <= 1:
        raise InvalidPlan("max_error_rate is a fraction from 0 to 1")
    if request.max_ttft_p95_ratio < 1:
        raise InvalidPlan("max_ttft_p95_ratio is at least 1 (the old target's own p95)")
    if request.min_requests < 1:
        raise InvalidPlan("min_requests is at least 1")


def _sole_target(alias: Alias) -> str:
    weighted = [name for name, weight in alias.targets.items() if weight > 0]
    if len(weighted) != 1:
        raise InvalidPlan(
            f"`{alias.name}` sends traffic to {len(weighted)} targets; name the from_target"
        )
    return str(weighted[0])


def preflight(plan: RolloutPlan) -> list[str]:
    """Why the plan cannot start now (empty: it can)."""
    problems: list[str] = []
    alias = Alias.objects.get(pk=plan.alias_id)
    others = RolloutPlan.objects.filter(alias=alias, state__in=ACTIVE_ROLLOUT_STATES)
    other = others.exclude(pk=plan.pk).first()
    if other is not None:
        problems.append(f"rollout #{other.pk} is {other.state} on `{alias.name}`")
    weighted = {name for name, weight in alias.targets.items() if weight > 0}
    if plan.from_target not in weighted:
        problems.append(f"`{alias.name}` sends no traffic to `{plan.from_target}`")
    if weighted - {plan.from_target, plan.to_target}:
        extra = ", ".join(sorted(weighted - {plan.from_target, plan.to_target}))
        problems.append(f"`{alias.name}` also sends traffic to {extra}")
    if not healthy_workers(plan.to_target):
        problems.append(f"no healthy worker serves `{plan.to_target}`")
    return problems


def healthy_workers(model: str) -> list[Worker]:
    now = timezone.now()
    expiry = settings.CONTROLPANEL_HEARTBEAT_EXPIRY
    return [
        w
        for w in Worker.objects.filter(state=WorkerState.ACTIVE)
        if model in w.model_ids and w.is_routable(expiry, now)
    ]
