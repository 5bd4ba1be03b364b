"""Creating rollout plans (controlpanel.rollouts.plans): steps and gates checked, the old
target found, and the pre-flight checks a plan must pass to start now."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.registry.models import Alias, Event, RolloutPlan, Worker
from controlpanel.rollouts import aliases, plans

ONE_STEP = ({"weight": 100, "hold_seconds": 0},)


@pytest.mark.parametrize(
    ("steps", "words"),
    [
        ((), "at least one step"),
        (({"weight": 0},), "integer from 1 to 100"),
        (({"weight": True},), "integer from 1 to 100"),
        (({"weight": 50.0},), "integer from 1 to 100"),
        (({"weight": 100, "hold_seconds": -1},), "hold_seconds is a number"),
        (({"weight": 100, "hold_seconds": 8 * 86400},), "hold_seconds is a number"),
        (({"weight": 100, "hold_seconds": "60"},), "hold_seconds is a number"),
        (({"weight": 50}, {"weight": 50}, {"weight": 100}), "must rise"),
        (({"weight": 10}, {"weight": 90}), "the last step must send 100%"),
    ],
)
def test_bad_steps_are_refused(steps: tuple[dict[str, Any], ...], words: str) -> None:
    with pytest.raises(plans.InvalidPlan, match=words):
        plans.steps_clean(steps)


def test_steps_are_kept_with_their_holds_in_seconds() -> None:
    clean = plans.steps_clean([{"weight": 5, "hold_seconds": 30}, {"weight": 100}])
    assert clean == [{"weight": 5, "hold_seconds": 30.0}, {"weight": 100, "hold_seconds": 0.0}]


@pytest.mark.parametrize(
    ("gates", "words"),
    [
        ({"max_error_rate": 1.5}, "max_error_rate is a fraction"),
        ({"max_ttft_p95_ratio": 0.9}, "at least 1"),
        ({"min_requests": 0}, "min_requests is at least 1"),
        ({"to_target": "v1"}, "must differ"),
        ({"to_target": "chat"}, "its own target"),
    ],
)
def test_bad_gates_and_targets_are_refused_and_nothing_kept(
    chat: Alias, gates: dict[str, Any], words: str
) -> None:
    fields = {"alias": "chat", "to_target": "v2", "steps": ONE_STEP, **gates}
    with pytest.raises(plans.InvalidPlan, match=words):
        plans.rollout_create(request=plans.PlanRequest(**fields), actor="ops")
    assert not RolloutPlan.objects.exists()


def test_an_alias_split_between_targets_needs_the_old_one_named(chat: Alias) -> None:
    aliases.alias_update(name="chat", targets={"v1": 50, "v3": 50, "v2": 0}, actor="ops")
    request = plans.PlanRequest(alias="chat", to_target="v2", steps=ONE_STEP)
    with pytest.raises(plans.InvalidPlan, match="sends traffic to 2 targets; name the from_target"):
        plans.rollout_create(request=request, actor="ops")
    named = plans.PlanRequest(alias="chat", to_target="v2", from_target="v1", steps=ONE_STEP)
    with pytest.raises(plans.PreflightFailed) as refused:
        plans.rollout_create(request=named, actor="ops")
    assert refused.value.problems == ["`chat` also sends traffic to v3"]
    assert refused.value.status == 409 and not RolloutPlan.objects.exists()


def test_preflight_lists_every_problem(chat: Alias) -> None:
    Worker.objects.filter(name="w2").update(state="drained")
    plan = RolloutPlan(alias=chat, from_target="v0", to_target="v2", steps=list(ONE_STEP))
    assert plans.preflight(plan) == [
        "`chat` sends no traffic to `v0`",
        "`chat` also sends traffic to v1",
        "no healthy worker serves `v2`",
    ]


def test_a_sleeping_or_expired_worker_is_not_healthy(chat: Alias) -> None:
    assert [w.name for w in plans.healthy_workers("v2")] == ["w2"]
    Worker.objects.filter(name="w2").update(sleeping=True)
    assert plans.healthy_workers("v2") == []
    long_ago = timezone.now() - timedelta(days=1)
    Worker.objects.filter(name="w2").update(sleeping=False, source="agent", last_heartbeat=long_ago)
    assert plans.healthy_workers("v2") == []


def test_a_plan_for_later_is_kept_without_preflight_and_not_started(chat: Alias) -> None:
    Worker.objects.filter(name="w2").update(state="drained")  # would fail pre-flight now
    later = timezone.now() + timedelta(hours=2)
    request = plans.PlanRequest(alias="chat", to_target="v2", steps=ONE_STEP, start_at=later)
    plan = plans.rollout_create(request=request, actor="ops")
    assert (plan.state, plan.step_index, plan.reason) == ("scheduled", -1, "scheduled")
    assert Alias.objects.get(name="chat").targets == {"v1": 100}
    event = Event.objects.latest("pk")
    assert event.message.endswith(f"scheduled: created for {later.isoformat()}")


def test_a_start_time_in_the_past_starts_now(chat: Alias) -> None:
    earlier = timezone.now() - timedelta(minutes=1)
    request = plans.PlanRequest(
        alias="chat", to_target="v2", steps=ONE_STEP, start_at=earlier, drain_old=True
    )
    plan = plans.rollout_create(request=request, actor="ops")
    assert plan.state == "running" and plan.created_by == "ops" and plan.drain_old
    assert Alias.objects.get(name="chat").targets == {"v1": 0, "v2": 100}
    with pytest.raises(plans.PreflightFailed, match=f"rollout #{plan.pk} is running"):
        plans.rollout_create(
            request=plans.PlanRequest(alias="chat", to_target="v2", steps=ONE_STEP,
                                      from_target="v1"),
            actor="ops",
        )  # fmt: skip
