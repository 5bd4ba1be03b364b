"""Admin API for aliases (/api/aliases) and rollout plans (/api/rollouts)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Router, Schema, Status

from controlpanel.api.auth import ADMIN_AUTH
from controlpanel.api.limits import MAX_INT
from controlpanel.api.strict import StrictIn
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.choices import RolloutState
from controlpanel.registry.models import ACTIVE_ROLLOUT_STATES, Alias, RolloutPlan
from controlpanel.rollouts import aliases, plans, transitions

router = Router(auth=ADMIN_AUTH)


class AliasIn(StrictIn):
    name: str = Field(max_length=300)
    targets: dict[str, int]  # {model name: weight}
    description: str = Field(default="", max_length=500)
    # Ordered model or alias names its requests move on to (routing.fleet.fallbacks).
    fallbacks: list[str] = Field(default_factory=list, max_length=64)


class AliasPatch(StrictIn):
    targets: dict[str, int] | None = None
    description: str | None = Field(default=None, max_length=500)
    fallbacks: list[str] | None = Field(default=None, max_length=64)


class AliasOut(Schema):
    name: str
    targets: dict[str, int]
    description: str
    fallbacks: list[str]
    # How many healthy workers serve each target now, so an admin sees a dead target.
    healthy_workers: dict[str, int]
    active_rollout: int | None
    updated_at: datetime

    @staticmethod
    def resolve_healthy_workers(obj: Alias) -> dict[str, int]:
        return {name: len(plans.healthy_workers(name)) for name in obj.targets}

    @staticmethod
    def resolve_active_rollout(obj: Alias) -> int | None:
        plan = obj.rollouts.filter(state__in=ACTIVE_ROLLOUT_STATES).first()
        return plan.pk if plan else None


class StepIn(StrictIn):
    weight: int = Field(ge=1, le=100, description="% of the alias's traffic to the new target")
    hold_seconds: float = Field(ge=0, le=plans.WEEK)


class GatesIn(StrictIn):
    max_error_rate: float = Field(default=0.02, ge=0, le=1)
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1)
    min_requests: int = Field(default=50, ge=1, le=MAX_INT)


class RolloutIn(StrictIn):
    alias: str
    to_target: str = Field(min_length=1, max_length=300)
    from_target: str | None = Field(default=None, max_length=300)
    steps: list[StepIn] | None = Field(default=None, min_length=1, max_length=50)
    start_at: datetime | None = None  # absent or past: start now
    gates: GatesIn = GatesIn()
    drain_old: bool = False


class RolloutOut(Schema):
    id: int
    alias: str
    from_target: str
    to_target: str
    state: str
    steps: list[dict[str, Any]]
    step: int | None = Field(description="the current step, from 1")
    weight: int | None = Field(description="% to the new target now")
    hold_left_s: float | None
    start_at: datetime | None
    gates: dict[str, Any]
    drain_old: bool
    reason: str
    last_check: dict[str, Any]
    history: list[dict[str, Any]]
    preflight: list[str] = Field(description="why a scheduled plan could not start now")
    created_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


Action = Literal["pause", "resume", "advance", "abort", "rollback"]


def rollout_out(plan: RolloutPlan) -> dict[str, Any]:
    step = plan.current_step
    return {
        "id": plan.pk,
        "alias": plan.alias.name,
        "from_target": plan.from_target,
        "to_target": plan.to_target,
        "state": plan.state,
        "steps": plan.steps,
        "step": plan.step_index + 1 if step else None,
        "weight": step["weight"] if step else None,
        "hold_left_s": _rounded(plan.hold_left()),
        "start_at": plan.start_at,
        "gates": {
            "max_error_rate": plan.max_error_rate,
            "max_ttft_p95_ratio": plan.max_ttft_p95_ratio,
            "min_requests": plan.min_requests,
        },
        "drain_old": plan.drain_old,
        "reason": plan.reason,
        "last_check": plan.last_check,
        "history": plan.history,
        "preflight": plans.preflight(plan) if plan.state == RolloutState.SCHEDULED else [],
        "created_by": plan.created_by,
        "created_at": plan.created_at,
        "updated_at": plan.updated_at,
        "finished_at": plan.finished_at,
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# --- aliases ------------------------------------------------------------------------------


@router.get("/aliases", response=list[AliasOut], tags=["aliases"])
def aliases_list(request: HttpRequest) -> Any:
    return list(Alias.objects.all())


@router.post("/aliases", response={201: AliasOut}, tags=["aliases"])
def aliases_create(request: HttpRequest, payload: AliasIn) -> Any:
    alias = aliases.alias_create(
        name=payload.name,
        targets=payload.targets,
        description=payload.description,
        fallbacks=payload.fallbacks,
        actor=request_actor(request),
    )
    return Status(201, alias)


@router.get("/aliases/{path:name}", response=AliasOut, tags=["aliases"])
def aliases_get(request: HttpRequest, name: str) -> Any:
    alias = Alias.objects.filter(name=name).first()
    if alias is None:
        raise aliases.AliasNotFound(f"no alias `{name}`")
    return alias


@router.patch("/aliases/{path:name}", response=AliasOut, tags=["aliases"])
def aliases_update(request: HttpRequest, name: str, payload: AliasPatch) -> Any:
    return aliases.alias_update(
        name=name,
        targets=payload.targets,
        description=payload.description,
        fallbacks=payload.fallbacks,
        actor=request_actor(request),
    )


@router.delete("/aliases/{path:name}", response={204: None}, tags=["aliases"])
def aliases_delete(request: HttpRequest, name: str) -> Any:
    aliases.alias_delete(name=name, actor=request_actor(request))
    return Status(204, None)


# --- rollouts -----------------------------------------------------------------------------


@router.get("/rollouts", response=list[RolloutOut], tags=["rollouts"])
def rollouts_list(request: HttpRequest, state: str | None = None, alias: str | None = None) -> Any:
    plans = RolloutPlan.objects.select_related("alias")
    if state:
        plans = plans.filter(state=state)
    if alias:
        plans = plans.filter(alias__name=alias)
    return [rollout_out(plan) for plan in plans[:200]]


@router.post("/rollouts", response={201: RolloutOut}, tags=["rollouts"])
def rollouts_create(request: HttpRequest, payload: RolloutIn) -> Any:
    """Create a plan. Without `start_at` (or with one in the past) it starts at once, after
    pre-flight checks; a refused start answers 409 with the reasons."""
    steps = tuple(s.dict() for s in payload.steps) if payload.steps else plans.DEFAULT_STEPS
    start_at = payload.start_at
    if start_at is not None and timezone.is_naive(start_at):
        start_at = timezone.make_aware(start_at)
    plan = plans.rollout_create(
        request=plans.PlanRequest(
            alias=payload.alias,
            to_target=payload.to_target,
            from_target=payload.from_target,
            steps=steps,
            start_at=start_at,
            max_error_rate=payload.gates.max_error_rate,
            max_ttft_p95_ratio=payload.gates.max_ttft_p95_ratio,
            min_requests=payload.gates.min_requests,
            drain_old=payload.drain_old,
        ),
        actor=request_actor(request),
    )
    return Status(201, rollout_out(plan))


@router.get("/rollouts/{int:plan_id}", response=RolloutOut, tags=["rollouts"])
def rollouts_get(request: HttpRequest, plan_id: int) -> Any:
    return rollout_out(transitions.rollout_get(plan_id))


@router.post("/rollouts/{int:plan_id}/{action}", response=RolloutOut, tags=["rollouts"])
def rollouts_act(request: HttpRequest, plan_id: int, action: Action) -> Any:
    """pause, resume, advance (skip the rest of this step's hold and its gates), abort
    (hold the weights where they are) or rollback (weights back to before the plan)."""
    plan = transitions.rollout_action(plan_id=plan_id, action=action, actor=request_actor(request))
    return rollout_out(plan)
