"""Rollout transitions: the one state machine that shifts an alias's traffic.

    scheduled ─▶ running ◀─▶ paused
        │          │  └──────────┴──▶ rolling_back ─▶ rolled_back
        │          └─▶ completed
        └──────────┴──────────┴──▶ aborted (holds the weights where they are)

Every transition is claimed with a conditional UPDATE on the plan's (state, version), in
the same transaction as the alias weights it sets and the event that records it, so two
Celery workers (or a worker and an admin) can never both advance a plan: the loser's UPDATE
matches no row and it walks away. All timing lives in the database (the step's start, the
hold left at a pause), so a restart of every process resumes a plan where it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlpanel.fleet.services import worker_drain
from controlpanel.registry.choices import EventKind, RolloutState, WorkerState
from controlpanel.registry.errors import InvalidTransition, ServiceError
from controlpanel.registry.events import event_record
from controlpanel.registry.models import (
    ROUTER_LIVENESS,
    RolloutPlan,
    RouterInstance,
    RoutingGeneration,
    Worker,
)
from controlpanel.rollouts.aliases import set_weights, weights_text

S = RolloutState
# Which states each admin action may leave from.
ACTIONS: Mapping[str, tuple[str, ...]] = {
    "pause": (S.RUNNING,),
    "resume": (S.PAUSED,),
    "advance": (S.RUNNING, S.PAUSED),
    "abort": (S.SCHEDULED, S.RUNNING, S.PAUSED),
    "rollback": (S.RUNNING, S.PAUSED, S.ABORTED),
}


class RolloutNotFound(ServiceError):
    status = 404


def transition(
    plan: RolloutPlan,
    to_state: str,
    *,
    allowed: Iterable[str],
    actor: str,
    reason: str,
    weights: dict[str, int] | None = None,
    **fields: Any,
) -> RolloutPlan:
    """Claim a transition: it happens only if nobody moved the plan since it was read."""
    allowed = tuple(allowed)
    if plan.state not in allowed:
        raise InvalidTransition(f"rollout #{plan.pk} is {plan.state}; it cannot go to {to_state}")
    with transaction.atomic():
        claimed = RolloutPlan.objects.filter(
            pk=plan.pk, version=plan.version, state__in=allowed
        ).update(
            state=to_state,
            version=F("version") + 1,
            reason=reason,
            updated_at=timezone.now(),
            **fields,
        )
        if not claimed:
            raise InvalidTransition(f"rollout #{plan.pk} changed meanwhile; reload and retry")
        if weights is not None:
            set_weights(plan.alias, weights, actor, f"weights set by rollout #{plan.pk}")
            RolloutPlan.objects.filter(pk=plan.pk).update(
                step_generation=RoutingGeneration.current()
            )
        plan_event(plan, plan.state, to_state, reason, actor, step=fields.get("step_index"))
    plan.refresh_from_db()
    return plan


def plan_event(
    plan: RolloutPlan,
    from_state: str | None,
    to_state: str,
    reason: str,
    actor: str,
    *,
    step: int | None = None,
) -> None:
    step = plan.step_index if step is None else step
    event_record(
        kind=EventKind.ROLLOUT,
        worker=None,
        message=f"rollout #{plan.pk} ({plan.alias.name}: {plan.from_target} → "
        f"{plan.to_target}) {to_state.replace('_', ' ')}: {reason}",  # "rolled back", as read
        actor=actor,
        data={"plan": plan.pk, "from": from_state, "to": to_state, "step": step,
              "before": {"state": from_state} if from_state else {},
              "after": {"state": to_state}},
    )  # fmt: skip


def step_weights(plan: RolloutPlan, index: int) -> dict[str, int]:
    weight = int(plan.steps[index]["weight"])
    return {plan.from_target: 100 - weight, plan.to_target: weight}


def start(plan: RolloutPlan, actor: str) -> RolloutPlan:
    return transition(
        plan,
        S.RUNNING,
        allowed=(S.SCHEDULED,),
        actor=actor,
        reason=f"started: step 1 of {len(plan.steps)}",
        weights=step_weights(plan, 0),
        step_index=0,
        step_started_at=timezone.now(),
        step_baseline={},
        original_targets=dict(plan.alias.targets),
    )


def next_step(plan: RolloutPlan, actor: str, reason: str) -> RolloutPlan:
    """Move to the next step, or complete after the last one."""
    record = [*plan.history, _step_record(plan)]
    reference = _old_p95(plan) or plan.reference_ttft_p95
    if plan.step_index + 1 >= len(plan.steps):
        return _complete(plan, actor, reason, record, reference)
    index = plan.step_index + 1
    return transition(
        plan,
        S.RUNNING,
        allowed=(S.RUNNING, S.PAUSED),
        actor=actor,
        reason=f"{reason}; step {index + 1} of {len(plan.steps)}",
        weights=step_weights(plan, index),
        step_index=index,
        step_started_at=timezone.now(),
        step_baseline={},
        paused_remaining=None,
        history=record,
        reference_ttft_p95=reference,
    )


def _complete(
    plan: RolloutPlan,
    actor: str,
    reason: str,
    record: list[dict[str, Any]],
    reference: float | None,
) -> RolloutPlan:
    plan = transition(
        plan,
        S.COMPLETED,
        allowed=(S.RUNNING, S.PAUSED),
        actor=actor,
        reason=f"{reason}; all traffic on {plan.to_target}",
        weights={plan.to_target: 100},
        paused_remaining=None,
        history=record,
        reference_ttft_p95=reference,
        finished_at=timezone.now(),
    )
    if plan.drain_old:
        _drain_target(plan, actor)
    return plan


def _drain_target(plan: RolloutPlan, actor: str) -> None:
    """Drain the workers that served only the old version (not the new one too)."""
    for worker in Worker.objects.filter(state=WorkerState.ACTIVE):
        served = worker.model_ids
        if plan.from_target in served and plan.to_target not in served:
            worker_drain(worker_id=worker.pk, actor=f"rollout #{plan.pk}")


def _step_record(plan: RolloutPlan) -> dict[str, Any]:
    check = plan.last_check or {}
    return {
        "step": plan.step_index + 1,
        "weight": plan.steps[plan.step_index]["weight"] if plan.current_step else None,
        "started_at": plan.step_started_at.isoformat() if plan.step_started_at else None,
        "ended_at": timezone.now().isoformat(),
        "new": check.get("new"),
        "old": check.get("old"),
    }


def _old_p95(plan: RolloutPlan) -> float | None:
    old = (plan.last_check or {}).get("old") or {}
    if (old.get("requests") or 0) >= plan.min_requests:
        value = old.get("ttft_p95")
        return float(value) if value is not None else None
    return None


def rollout_action(*, plan_id: int, action: str, actor: str) -> RolloutPlan:
    """An admin's pause, resume, advance, abort or rollback."""
    plan = rollout_get(plan_id)
    if action not in ACTIONS:
        raise InvalidTransition(f"unknown action `{action}`")
    allowed = ACTIONS[action]
    if plan.state not in allowed:
        raise InvalidTransition(f"rollout #{plan.pk} is {plan.state}: it cannot {action}")
    if action == "rollback" and plan.step_index < 0:
        raise InvalidTransition(f"rollout #{plan.pk} never started: nothing to roll back")
    if action == "pause":
        return transition(
            plan,
            S.PAUSED,
            allowed=allowed,
            actor=actor,
            reason="paused",
            paused_remaining=plan.hold_left(),
        )
    if action == "resume":
        return _resume(plan, actor)
    if action == "advance":
        return next_step(plan, actor, "advanced by hand")
    if action == "abort":
        return transition(
            plan,
            S.ABORTED,
            allowed=allowed,
            actor=actor,
            reason="aborted; weights held where they were",
            finished_at=timezone.now(),
        )
    return rollback(plan, actor, "rolled back by hand")


def _resume(plan: RolloutPlan, actor: str) -> RolloutPlan:
    step = plan.current_step or {"hold_seconds": 0}
    left = plan.paused_remaining if plan.paused_remaining is not None else 0.0
    already = max(0.0, float(step["hold_seconds"]) - left)
    return transition(
        plan,
        S.RUNNING,
        allowed=(S.PAUSED,),
        actor=actor,
        reason=f"resumed with {left:.0f} s of the hold left",
        step_started_at=timezone.now() - timedelta(seconds=already),
        paused_remaining=None,
    )


def rollback(plan: RolloutPlan, actor: str, reason: str) -> RolloutPlan:
    """Weights go back to what the alias had before the plan, at once; the plan is
    rolled_back once every live router routes with them."""
    original = plan.original_targets or {plan.from_target: 100}
    plan = transition(
        plan,
        S.ROLLING_BACK,
        allowed=(S.RUNNING, S.PAUSED, S.ABORTED),
        actor=actor,
        reason=reason,
        weights=dict(original),
        paused_remaining=None,
        history=[*plan.history, _step_record(plan)] if plan.current_step else plan.history,
    )
    RolloutPlan.objects.filter(pk=plan.pk).update(rollback_generation=RoutingGeneration.current())
    plan.refresh_from_db()
    return finish_rollback(plan)


def finish_rollback(plan: RolloutPlan) -> RolloutPlan:
    needed = plan.rollback_generation or 0
    generations = RouterInstance.live(ROUTER_LIVENESS).values_list("generation", flat=True)
    if any(generation < needed for generation in generations):
        return plan
    return transition(
        plan,
        S.ROLLED_BACK,
        allowed=(S.ROLLING_BACK,),
        actor="router",
        reason=f"every router sends `{plan.alias.name}` to {weights_text(plan.alias.targets)}",
        finished_at=timezone.now(),
    )


def rollout_get(plan_id: int) -> RolloutPlan:
    try:
        return RolloutPlan.objects.select_related("alias").get(pk=plan_id)
    except RolloutPlan.DoesNotExist:
        raise RolloutNotFound(f"no rollout #{plan_id}") from None
