"""The rollout clock: Celery beat ticks it every CONTROLPANEL_ROLLOUT_TICK_SECONDS to start
due plans, check the running step's gates, move steps and finish rollbacks."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.utils import timezone

from controlpanel.registry.choices import RolloutState
from controlpanel.registry.errors import InvalidTransition
from controlpanel.registry.models import ROUTER_LIVENESS, RolloutPlan, RouterInstance
from controlpanel.rollouts import gates
from controlpanel.rollouts.plans import healthy_workers, preflight
from controlpanel.rollouts.transitions import (
    finish_rollback,
    next_step,
    rollback,
    start,
    transition,
)

log = logging.getLogger(__name__)

S = RolloutState


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
            transition(
                plan,
                S.ABORTED,
                allowed=(S.SCHEDULED,),
                actor="scheduler",
                reason="could not start: " + "; ".join(problems),
                finished_at=now,
            )
            return 1
        start(plan, "scheduler")
        return 1
    if plan.state == S.ROLLING_BACK:
        return int(finish_rollback(plan).version != version)
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
        next_step(plan, "gate", f"step {plan.step_index + 1} passed its gates")
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
