"""Aliases and rollout plans: the one state machine that shifts an alias's traffic.

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

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlpanel import gates
from controlpanel.models import (
    ACTIVE_ROLLOUT_STATES,
    Alias,
    EventKind,
    RolloutPlan,
    RolloutState,
    RouterInstance,
    RoutingGeneration,
    Worker,
    WorkerState,
)
from controlpanel.services import (
    ROUTER_LIVENESS,
    InvalidTransition,
    ServiceError,
    event_record,
    worker_drain,
)

log = logging.getLogger(__name__)

S = RolloutState
WEEK = 7 * 86400
ALIAS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,299}$")
DEFAULT_STEPS = (
    {"weight": 5, "hold_seconds": 600},
    {"weight": 25, "hold_seconds": 600},
    {"weight": 50, "hold_seconds": 600},
    {"weight": 100, "hold_seconds": 0},
)
# Which states each admin action may leave from.
ACTIONS: Mapping[str, tuple[str, ...]] = {
    "pause": (S.RUNNING,),
    "resume": (S.PAUSED,),
    "advance": (S.RUNNING, S.PAUSED),
    "abort": (S.SCHEDULED, S.RUNNING, S.PAUSED),
    "rollback": (S.RUNNING, S.PAUSED, S.ABORTED),
}


class InvalidAlias(ServiceError):
    status = 422


class AliasNotFound(ServiceError):
    status = 404


class AliasExists(ServiceError):
    status = 409


class AliasBusy(ServiceError):
    status = 409


class InvalidPlan(ServiceError):
    status = 422


class PreflightFailed(ServiceError):
    status = 409

    def __init__(self, problems: list[str]) -> None:
        super().__init__("pre-flight checks failed: " + "; ".join(problems))
        self.problems = problems


class RolloutNotFound(ServiceError):
    status = 404


# --- aliases ------------------------------------------------------------------------------


def alias_targets_clean(targets: Any) -> dict[str, int]:
    if not isinstance(targets, dict) or not targets:
        raise InvalidAlias("targets must be a non-empty object of {model name: weight}")
    clean: dict[str, int] = {}
    for name, weight in targets.items():
        if not isinstance(name, str) or not name.strip():
            raise InvalidAlias("a target's model name must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 10_000:
            raise InvalidAlias(f"the weight of `{name}` must be an integer from 0 to 10000")
        clean[name.strip()] = weight
    if not any(clean.values()):
        raise InvalidAlias("at least one target needs a weight above 0")
    return clean


def alias_create(*, name: str, targets: Any, description: str = "", actor: str) -> Alias:
    name = name.strip()
    if not ALIAS_NAME.match(name):
        raise InvalidAlias(
            "an alias name is 1-300 letters, digits or . _ : / @ + -, starting with a letter "
            "or digit"
        )
    clean = alias_targets_clean(targets)
    if name in clean:
        raise InvalidAlias("an alias cannot be its own target")
    with transaction.atomic():
        if Alias.objects.filter(name=name).exists():
            raise AliasExists(f"the alias `{name}` exists already")
        alias = Alias.objects.create(name=name, targets=clean, description=description)
        _alias_event(alias, f"created: {weights_text(clean)}", actor)
        RoutingGeneration.bump()
    return alias


def alias_update(
    *, name: str, targets: Any = None, description: str | None = None, actor: str
) -> Alias:
    with transaction.atomic():
        alias = _alias_locked(name)
        if targets is not None:
            _refuse_during_rollout(alias, "change its weights")
            clean = alias_targets_clean(targets)
            if alias.name in clean:
                raise InvalidAlias("an alias cannot be its own target")
            _set_weights(alias, clean, actor, f"weights set: {weights_text(clean)}")
        if description is not None:
            alias.description = description
            alias.save(update_fields=["description", "updated_at"])
    return alias


def alias_delete(*, name: str, actor: str) -> None:
    with transaction.atomic():
        alias = _alias_locked(name)
        _refuse_during_rollout(alias, "delete it")
        RolloutPlan.objects.filter(alias=alias).exclude(state__in=ACTIVE_ROLLOUT_STATES).delete()
        if alias.rollouts.exists():
            raise AliasBusy(f"the alias `{name}` has a scheduled plan; abort it first")
        _alias_event(alias, "deleted", actor)
        alias.delete()
        RoutingGeneration.bump()


def _alias_locked(name: str) -> Alias:
    try:
        return Alias.objects.select_for_update().get(name=name)
    except Alias.DoesNotExist:
        raise AliasNotFound(f"no alias `{name}`") from None


def _refuse_during_rollout(alias: Alias, what: str) -> None:
    plan = alias.rollouts.filter(state__in=ACTIVE_ROLLOUT_STATES).first()
    if plan is not None:
        raise AliasBusy(
            f"rollout #{plan.pk} is {plan.state} on `{alias.name}`: finish, abort or roll it "
            f"back before you {what}"
        )


def _set_weights(alias: Alias, targets: dict[str, int], actor: str, message: str) -> None:
    alias.targets = targets
    alias.save(update_fields=["targets", "updated_at"])
    _alias_event(alias, message, actor)
    RoutingGeneration.bump()


def _alias_event(alias: Alias, message: str, actor: str) -> None:
    event_record(
        kind=EventKind.ALIAS_CHANGED,
        worker=None,
        message=f"alias {alias.name} {message}",
        actor=actor,
        data={"alias": alias.name, "targets": alias.targets},
    )


def weights_text(targets: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {weight}" for name, weight in targets.items())


def aliases_as_routes() -> dict[str, dict[str, int]]:
    """For the router's snapshot: {alias: {target: weight}}."""
    return {name: dict(targets) for name, targets in Alias.objects.values_list("name", "targets")}


# --- creating plans -----------------------------------------------------------------------


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
        alias = _alias_locked(request.alias)
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
        _plan_event(plan, None, S.SCHEDULED, f"created {when}", actor)
    return _start(plan, actor) if starts_now else plan


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


# --- transitions --------------------------------------------------------------------------


def _transition(
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
            _set_weights(plan.alias, weights, actor, f"weights set by rollout #{plan.pk}")
            RolloutPlan.objects.filter(pk=plan.pk).update(
                step_generation=RoutingGeneration.current()
            )
        _plan_event(plan, plan.state, to_state, reason, actor, step=fields.get("step_index"))
    plan.refresh_from_db()
    return plan


def _plan_event(
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
        f"{plan.to_target}) {to_state}: {reason}",
        actor=actor,
        data={"plan": plan.pk, "from": from_state, "to": to_state, "step": step},
    )


def step_weights(plan: RolloutPlan, index: int) -> dict[str, int]:
    weight = int(plan.steps[index]["weight"])
    return {plan.from_target: 100 - weight, plan.to_target: weight}


def _start(plan: RolloutPlan, actor: str) -> RolloutPlan:
    return _transition(
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


def _next_step(plan: RolloutPlan, actor: str, reason: str) -> RolloutPlan:
    """Move to the next step, or complete after the last one."""
    record = [*plan.history, _step_record(plan)]
    reference = _old_p95(plan) or plan.reference_ttft_p95
    if plan.step_index + 1 >= len(plan.steps):
        return _complete(plan, actor, reason, record, reference)
    index = plan.step_index + 1
    return _transition(
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
    plan = _transition(
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
        return _transition(
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
        return _next_step(plan, actor, "advanced by hand")
    if action == "abort":
        return _transition(
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
    return _transition(
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
    plan = _transition(
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
    return _finish_rollback(plan)


def _finish_rollback(plan: RolloutPlan) -> RolloutPlan:
    needed = plan.rollback_generation or 0
    generations = RouterInstance.live(ROUTER_LIVENESS).values_list("generation", flat=True)
    if any(generation < needed for generation in generations):
        return plan
    return _transition(
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


# --- the clock: Celery beat calls this every CONTROLPANEL_ROLLOUT_TICK_SECONDS -------------


def rollouts_tick(now: datetime | None = None) -> int:
    """Start due plans, check gates, move steps, finish rollbacks. Returns transitions made."""
    now = now or timezone.now()
    moved = 0
    plans = RolloutPlan.objects.select_related("alias").filter(
        state__in=(S.SCHEDULED, S.RUNNING, S.ROLLING_BACK)
    )
    for plan in plans:
        try:
            moved += _tick_plan(plan, now)
        except InvalidTransition:
            log.info("rollout #%s moved meanwhile; another tick has it", plan.pk)
    return moved


def _tick_plan(plan: RolloutPlan, now: datetime) -> int:
    version = plan.version
    if plan.state == S.SCHEDULED:
        if plan.start_at is not None and plan.start_at > now:
            return 0
        problems = preflight(plan)
        if problems:
            _transition(
                plan,
                S.ABORTED,
                allowed=(S.SCHEDULED,),
                actor="scheduler",
                reason="could not start: " + "; ".join(problems),
                finished_at=now,
            )
            return 1
        _start(plan, "scheduler")
        return 1
    if plan.state == S.ROLLING_BACK:
        return int(_finish_rollback(plan).version != version)
    return _check_running(plan, now)


def _check_running(plan: RolloutPlan, now: datetime) -> int:
    current = traffic_now()
    baseline = _settled_baseline(plan, current)
    check = gate_check(plan, now, baseline, current)
    RolloutPlan.objects.filter(pk=plan.pk, version=plan.version).update(
        last_check=check.as_dict(), step_baseline=baseline
    )
    plan.last_check, plan.step_baseline = check.as_dict(), baseline
    if check.verdict == "fail":
        rollback(plan, "gate", f"gate failed at step {plan.step_index + 1}: {check.reason}")
        return 1
    if check.verdict == "pass":
        _next_step(plan, "gate", f"step {plan.step_index + 1} passed its gates")
        return 1
    return 0


def _settled_baseline(plan: RolloutPlan, current: dict[str, Any]) -> dict[str, Any]:
    """Add the routers that now route with the step's weights to the step's baseline."""
    baseline = dict(plan.step_baseline)
    needed = plan.step_generation or 0
    for instance_id, generation in RouterInstance.live(ROUTER_LIVENESS).values_list(
        "instance_id", "generation"
    ):
        if instance_id not in baseline and generation >= needed:
            baseline[instance_id] = current.get(instance_id) or {}
    return baseline


def gate_check(
    plan: RolloutPlan, now: datetime, baseline: dict[str, Any], current: dict[str, Any]
) -> gates.GateCheck:
    started = plan.step_started_at or now
    left = plan.hold_left(now)
    return gates.evaluate(
        new=gates.window(baseline, current, plan.to_target),
        old=gates.window(baseline, current, plan.from_target),
        thresholds=gates.Thresholds(
            plan.max_error_rate, plan.max_ttft_p95_ratio, plan.min_requests
        ),
        reference_p95=plan.reference_ttft_p95,
        hold_over=left is not None and left <= 0,
        new_has_worker=bool(healthy_workers(plan.to_target)),
        window_seconds=(now - started).total_seconds(),
    )


def traffic_now() -> dict[str, Any]:
    """Every known router's cumulative per-model totals, keyed by router instance."""
    return dict(RouterInstance.objects.values_list("instance_id", "traffic"))
