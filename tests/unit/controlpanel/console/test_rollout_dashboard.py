"""What the rollouts pages show of a plan: each side's weight and figures from the last
check, the gates (the p95 gate from the old target's reference), bars whose middle is the
gate, the hold's end, each step's status and duration, the actions its state allows, the
recent plans, and each alias's targets with their healthy workers."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.console import rollout_dashboard as rd
from controlpanel.registry.choices import RolloutState, WorkerSource
from controlpanel.registry.models import Alias, Event, RolloutPlan, Worker

pytestmark = pytest.mark.django_db
STEPS = [{"weight": 10, "hold_seconds": 600}, {"weight": 50, "hold_seconds": 7200},
         {"weight": 100, "hold_seconds": 45}]  # fmt: skip
CHECK = {
    "verdict": "hold", "reason": "too few requests", "old_p95_reference": 0.4,
    "old": {"rps": 9.0, "requests": 90, "error_rate": 0.01, "ttft_p95": 0.4},
    "new": {"rps": 1.0, "requests": 10, "error_rate": 0.05, "ttft_p95": 0.7},
}  # fmt: skip


def plan(state: str = RolloutState.RUNNING, **fields: Any) -> RolloutPlan:
    alias, _ = Alias.objects.get_or_create(name="chat", defaults={"targets": {"old": 100}})
    values: dict[str, Any] = {"alias": alias, "from_target": "old", "to_target": "new",
                              "steps": STEPS, "state": state, **fields}  # fmt: skip
    return RolloutPlan.objects.create(**values)


def test_a_running_plans_panel() -> None:
    started = timezone.now()
    running = plan(step_index=1, step_started_at=started, last_check=CHECK,
                   max_error_rate=0.02, max_ttft_p95_ratio=1.5)  # fmt: skip
    Event.objects.create(kind="rollout", message="step 2", data={"plan": running.pk})
    Event.objects.create(kind="rollout", message="another plan", data={"plan": 0})
    p = rd.panel(running)
    assert (p.old.weight, p.new.weight) == (50, 50)
    assert (p.old.requests, p.new.error_rate, p.new.ttft_p95) == (90, 0.05, 0.7)
    assert p.p95_gate == pytest.approx(0.6)
    assert p.new_breaks_error_gate and p.new_breaks_p95_gate
    assert p.error_bars == (pytest.approx(25.0), 100.0)  # 0.01 of a 0.04 bar; capped
    assert p.hold_until == pytest.approx(started.timestamp() + 7200)
    assert [(s["status"], s["hold"]) for s in p.steps] == [
        ("done", "10 min"), ("current", "2 h"), ("pending", "45 s"),
    ]  # fmt: skip
    assert p.actions == ["pause", "advance", "abort", "rollback"]
    assert (p.verdict, p.check_reason) == ("hold", "too few requests")
    assert [e.message for e in p.events] == ["step 2"]
    assert "chat" in rd.render_plan_row(running) and rd.fragments(running)["panel"]


def test_a_scheduled_plan_knows_nothing_yet_and_cannot_roll_back() -> None:
    p = rd.panel(plan(RolloutState.SCHEDULED))
    assert (p.old.weight, p.new.weight, p.new.error_rate) == (None, None, None)
    assert p.p95_gate is None and p.hold_until is None
    assert p.error_bars == (0.0, 0.0) and p.p95_bars == (0.0, 0.0)
    assert not p.new_breaks_error_gate and not p.new_breaks_p95_gate
    assert p.actions == ["abort"]
    assert {s["status"] for s in p.steps} == {"pending"}


def test_a_completed_plan_has_every_step_done_and_no_action() -> None:
    p = rd.panel(plan(RolloutState.COMPLETED, step_index=2))
    assert {s["status"] for s in p.steps} == {"done"} and p.actions == []


def test_recent_plans_are_the_active_and_the_last_days_ended() -> None:
    active = plan(RolloutState.PAUSED, step_index=0)
    scheduled = plan(RolloutState.SCHEDULED)
    ended = plan(RolloutState.ABORTED)
    old = plan(RolloutState.COMPLETED)
    RolloutPlan.objects.filter(pk=old.pk).update(updated_at=timezone.now() - timedelta(days=2))
    assert {p.pk for p in rd.recent_plans()} == {active.pk, scheduled.pk, ended.pk}
    assert rd.change_key(active) != rd.change_key(scheduled)


def test_alias_rows_show_targets_with_healthy_workers_and_the_active_plan() -> None:
    Worker.objects.create(url="http://127.0.0.1:9", name="w", source=WorkerSource.OPERATOR,
                          models=[{"id": "old"}], last_heartbeat=timezone.now())  # fmt: skip
    running = plan(step_index=0)
    Alias.objects.filter(name="chat").update(targets={"old": 90, "new": 10})
    (row,) = rd.alias_rows()
    assert row["weights_text"] == "old=90, new=10"
    assert [(t["name"], t["healthy"]) for t in row["targets"]] == [("old", 1), ("new", 0)]
    assert row["active"] == running
