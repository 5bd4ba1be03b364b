"""The rollout state machine (controlpanel.rollouts.transitions) on the database: what each
transition writes with its claim, the step history it keeps, and a rollback that waits for
every live router to route with the restored weights."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlpanel.registry.choices import EventKind
from controlpanel.registry.errors import InvalidTransition
from controlpanel.registry.models import (
    Alias,
    Event,
    RolloutPlan,
    RouterInstance,
    RoutingGeneration,
)
from controlpanel.rollouts import aliases, plans, transitions

STEPS = (
    {"weight": 10, "hold_seconds": 60},
    {"weight": 50, "hold_seconds": 60},
    {"weight": 100, "hold_seconds": 0},
)


def started(**changes: object) -> RolloutPlan:
    request = plans.PlanRequest(alias="chat", to_target="v2", steps=STEPS, **changes)  # type: ignore[arg-type]
    return plans.rollout_create(request=request, actor="ops")


def act(plan: RolloutPlan, action: str) -> RolloutPlan:
    return transitions.rollout_action(plan_id=plan.pk, action=action, actor="ops")


def targets() -> dict[str, int]:
    return dict(Alias.objects.get(name="chat").targets)


def router(instance: str, generation: int) -> None:
    now = timezone.now()
    RouterInstance.objects.update_or_create(
        instance_id=instance,
        defaults={"hostname": "h", "pid": 1, "started_at": now, "last_seen": now,
                  "generation": generation},
    )  # fmt: skip


def test_a_start_keeps_what_the_alias_had_and_when_the_step_reached_the_routers(
    chat: Alias,
) -> None:
    aliases.alias_update(name="chat", targets={"v1": 7, "v2": 0}, actor="ops")
    plan = started()
    assert (plan.state, plan.step_index, plan.version) == ("running", 0, 1)
    assert plan.original_targets == {"v1": 7, "v2": 0}
    assert targets() == {"v1": 90, "v2": 10}
    assert plan.step_generation == RoutingGeneration.current()
    event = Event.objects.filter(kind=EventKind.ROLLOUT).latest("pk")
    assert event.message == f"rollout #{plan.pk} (chat: v1 → v2) running: started: step 1 of 3"
    assert event.data["before"] == {"state": "scheduled"} and event.data["to"] == "running"


def test_each_step_is_recorded_and_the_old_targets_p95_becomes_the_reference(
    chat: Alias,
) -> None:
    plan = started(min_requests=20)
    check = {"new": {"requests": 30, "ttft_p95": 0.3}, "old": {"requests": 25, "ttft_p95": 0.2}}
    RolloutPlan.objects.filter(pk=plan.pk).update(last_check=check)
    plan = act(plan, "advance")
    assert (plan.step_index, targets()) == (1, {"v1": 50, "v2": 50})
    assert plan.reference_ttft_p95 == 0.2
    (record,) = plan.history
    assert (record["step"], record["weight"], record["old"]) == (1, 10, check["old"])
    # too little old traffic at the next step: the reference is kept, not dropped
    RolloutPlan.objects.filter(pk=plan.pk).update(last_check={"old": {"requests": 3}})
    plan = act(plan, "advance")
    assert (plan.state, plan.step_index, plan.reference_ttft_p95) == ("running", 2, 0.2)
    assert targets() == {"v1": 0, "v2": 100}  # the last step: all traffic, the plan still on
    plan = act(plan, "advance")
    assert plan.state == "completed" and plan.finished_at is not None
    assert targets() == {"v2": 100}
    assert [r["step"] for r in plan.history] == [1, 2, 3]


def test_a_rollback_waits_for_every_live_router_to_route_with_the_old_weights(
    chat: Alias,
) -> None:
    aliases.alias_update(name="chat", targets={"v1": 3}, actor="ops")
    plan = started()
    router("r1", RoutingGeneration.current())
    plan = act(plan, "rollback")
    assert plan.state == "rolling_back" and targets() == {"v1": 3}
    assert plan.rollback_generation == RoutingGeneration.current()
    assert transitions.finish_rollback(plan).state == "rolling_back"  # r1 is behind
    router("r1", plan.rollback_generation)
    done = transitions.finish_rollback(plan)
    assert done.state == "rolled_back" and done.finished_at is not None
    assert done.reason == "every router sends `chat` to v1 3"
    assert [r["step"] for r in done.history] == [1]


def test_a_paused_plan_may_advance_and_resumes_with_a_fresh_hold(chat: Alias) -> None:
    plan = act(started(), "pause")
    assert plan.state == "paused" and plan.paused_remaining is not None
    plan = act(plan, "advance")
    assert (plan.state, plan.step_index, plan.paused_remaining) == ("running", 1, None)
    assert 0 < (plan.hold_left() or 0) <= 60  # running again, holding step 2 afresh


@pytest.mark.parametrize(
    ("action", "words"),
    [("jump", "unknown action `jump`"), ("rollback", "never started: nothing to roll back")],
)
def test_refused_actions_say_why(chat: Alias, action: str, words: str) -> None:
    later = timezone.now() + timedelta(hours=1)
    plan = plans.rollout_create(
        request=plans.PlanRequest(alias="chat", to_target="v2", steps=STEPS, start_at=later),
        actor="ops",
    )
    if action == "rollback":  # a scheduled plan never started; make it one that may roll back
        RolloutPlan.objects.filter(pk=plan.pk).update(state="aborted")
    with pytest.raises(InvalidTransition, match=words):
        act(plan, action)


def test_a_claim_on_a_state_not_allowed_changes_nothing(chat: Alias) -> None:
    plan = started()
    version = plan.version
    with pytest.raises(InvalidTransition, match="it cannot go to completed"):
        transitions.transition(plan, "completed", allowed=("paused",), actor="ops", reason="x")
    assert RolloutPlan.objects.get(pk=plan.pk).version == version
    with pytest.raises(transitions.RolloutNotFound, match="no rollout #0"):
        transitions.rollout_get(0)


def test_step_weights_split_a_hundred(chat: Alias) -> None:
    plan = started()
    assert [transitions.step_weights(plan, i) for i in range(3)] == [
        {"v1": 90, "v2": 10}, {"v1": 50, "v2": 50}, {"v1": 0, "v2": 100},
    ]  # fmt: skip
