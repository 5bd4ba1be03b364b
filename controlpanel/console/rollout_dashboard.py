"""What the rollouts pages show: plan progress and the old/new comparison against the gates,
rendered by the same partials for the first page load and for the live feed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.template.loader import render_to_string
from django.utils import timezone

from controlpanel.registry.choices import EventKind, RolloutState
from controlpanel.registry.models import ACTIVE_ROLLOUT_STATES, Alias, Event, RolloutPlan
from controlpanel.rollouts import aliases, plans, transitions

RECENT = timedelta(hours=24)
BAR_SCALE = 2.0  # a bar's full width is twice its gate, so the gate mark sits in the middle


@dataclass(frozen=True)
class Side:
    """One target's column in the comparison."""

    label: str
    model: str
    weight: int | None
    rps: float | None
    requests: int
    error_rate: float | None
    ttft_p95: float | None


@dataclass(frozen=True)
class Panel:
    plan: RolloutPlan
    old: Side
    new: Side
    error_gate: float
    p95_gate: float | None  # seconds: ratio x the old target's p95, when that is known
    hold_until: float | None  # epoch seconds, for the page's own countdown
    steps: list[dict[str, Any]]
    actions: list[str]
    verdict: str
    check_reason: str
    events: list[Event]

    @property
    def error_bars(self) -> tuple[float, float]:
        gate = self.error_gate
        return _bar(self.old.error_rate, gate), _bar(self.new.error_rate, gate)

    @property
    def p95_bars(self) -> tuple[float, float]:
        return _bar(self.old.ttft_p95, self.p95_gate), _bar(self.new.ttft_p95, self.p95_gate)

    @property
    def new_breaks_error_gate(self) -> bool:
        return (self.new.error_rate or 0.0) > self.error_gate

    @property
    def new_breaks_p95_gate(self) -> bool:
        return bool(self.p95_gate and (self.new.ttft_p95 or 0.0) > self.p95_gate)


def _bar(value: float | None, gate: float | None) -> float:
    """Width in % of a bar whose middle is the gate."""
    if value is None or not gate:
        return 0.0
    return min(100.0, 100.0 * value / (gate * BAR_SCALE))


def panel(plan: RolloutPlan) -> Panel:
    check = plan.last_check or {}
    step = plan.current_step
    weight = int(step["weight"]) if step else None
    reference = check.get("old_p95_reference") or plan.reference_ttft_p95
    return Panel(
        plan=plan,
        old=_side("old", plan.from_target, None if weight is None else 100 - weight, check),
        new=_side("new", plan.to_target, weight, check),
        error_gate=plan.max_error_rate,
        p95_gate=reference * plan.max_ttft_p95_ratio if reference else None,
        hold_until=_hold_until(plan),
        steps=_steps(plan),
        actions=[a for a, states in transitions.ACTIONS.items() if _allowed(plan, a, states)],
        verdict=str(check.get("verdict") or ""),
        check_reason=str(check.get("reason") or ""),
        events=list(Event.objects.filter(kind=EventKind.ROLLOUT, data__plan=plan.pk)[:50]),
    )


def _side(label: str, model: str, weight: int | None, check: dict[str, Any]) -> Side:
    figures = check.get(label) or {}
    return Side(
        label=label,
        model=model,
        weight=weight,
        rps=figures.get("rps"),
        requests=int(figures.get("requests") or 0),
        error_rate=figures.get("error_rate"),
        ttft_p95=figures.get("ttft_p95"),
    )


def _hold_until(plan: RolloutPlan) -> float | None:
    step = plan.current_step
    if plan.state != RolloutState.RUNNING or step is None or plan.step_started_at is None:
        return None
    return plan.step_started_at.timestamp() + float(step["hold_seconds"])


def _steps(plan: RolloutPlan) -> list[dict[str, Any]]:
    finished = plan.state == RolloutState.COMPLETED
    return [
        {
            "number": i + 1,
            "weight": step["weight"],
            "hold": _duration(float(step["hold_seconds"])),
            "status": "done"
            if finished or i < plan.step_index
            else "current"
            if i == plan.step_index
            else "pending",
        }
        for i, step in enumerate(plan.steps)
    ]


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:.0f} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:g} s"


def _allowed(plan: RolloutPlan, action: str, states: tuple[str, ...]) -> bool:
    if action == "rollback" and plan.step_index < 0:
        return False
    return plan.state in states


def recent_plans() -> list[RolloutPlan]:
    """Active and scheduled plans, and those that ended in the last day (newest first)."""
    since = timezone.now() - RECENT
    active = (*ACTIVE_ROLLOUT_STATES, RolloutState.SCHEDULED)
    plans = RolloutPlan.objects.select_related("alias")
    return list(plans.filter(state__in=active)) + list(
        plans.exclude(state__in=active).filter(updated_at__gte=since)[:30]
    )


def render_plan_row(plan: RolloutPlan) -> str:
    return render_to_string("controlpanel/_rollout_row.html", {"p": panel(plan)})


def render_plan_panel(plan: RolloutPlan) -> str:
    return render_to_string("controlpanel/_rollout_panel.html", {"p": panel(plan)})


def fragments(plan: RolloutPlan) -> dict[str, str]:
    """A plan's list row and detail panel, for the live feed."""
    return {"row": render_plan_row(plan), "panel": render_plan_panel(plan)}


def change_key(plan: RolloutPlan) -> tuple[Any, ...]:
    """What the fragments show that can change (the countdown runs in the page itself)."""
    return (plan.version, plan.state, plan.step_index, repr(plan.last_check))


def alias_rows() -> list[dict[str, Any]]:
    rows = []
    for alias in Alias.objects.all():
        active = alias.rollouts.filter(state__in=ACTIVE_ROLLOUT_STATES).first()
        rows.append(
            {
                "alias": alias,
                "targets": [
                    {
                        "name": name,
                        "weight": weight,
                        "healthy": len(plans.healthy_workers(name)),
                    }
                    for name, weight in aliases.targets_in_order(alias.targets)
                ],
                "weights_text": ", ".join(
                    f"{n}={w}" for n, w in aliases.targets_in_order(alias.targets)
                ),
                "active": active,
            }
        )
    return rows
