"""The rollout clock (controlpanel.rollouts.clock) on the database, with routers' reports
written as RouterInstance rows and times passed in (no clock waited on)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from controlpanel.registry.models import Alias, RolloutPlan, RouterInstance, RoutingGeneration
from controlpanel.rollouts import clock, plans
from routing.telemetry.counters import GATE_TTFT_BUCKETS

STEPS = ({"weight": 10, "hold_seconds": 60}, {"weight": 100, "hold_seconds": 0})


def traffic(requests: int, errors: int = 0, ttft: float = 0.05) -> dict[str, Any]:
    counts = [0] * (len(GATE_TTFT_BUCKETS) + 1)
    counts[sum(1 for b in GATE_TTFT_BUCKETS if b < ttft)] = requests
    return {"requests": requests, "errors": errors, "ttft": counts}


def report(instance: str, generation: int, **models: dict[str, Any]) -> None:
    now = timezone.now()
    RouterInstance.objects.update_or_create(
        instance_id=instance,
        defaults={"hostname": "h", "pid": 1, "started_at": now, "last_seen": now,
                  "generation": generation, "traffic": models},
    )  # fmt: skip


def running() -> RolloutPlan:
    request = plans.PlanRequest(alias="chat", to_target="v2", steps=STEPS, min_requests=10)
    return plans.rollout_create(request=request, actor="ops")


def test_only_routers_on_the_steps_weights_join_its_baseline(chat: Alias) -> None:
    plan = running()
    step = plan.step_generation or 0
    report("behind", step - 1, v2=traffic(1000, 1000))  # still routing with the old weights
    report("on", step, v2=traffic(5), v1=traffic(50))
    assert clock.rollouts_tick() == 0
    plan.refresh_from_db()
    assert set(plan.step_baseline) == {"on"}
    assert plan.last_check["verdict"] == "wait"
    report("on", step, v2=traffic(5 + 12), v1=traffic(150))
    report("behind", step - 1, v2=traffic(2000, 2000))  # never counted, however bad
    later = timezone.now() + timedelta(seconds=61)
    assert clock.rollouts_tick(later) == 1
    plan.refresh_from_db()
    assert (plan.state, plan.step_index) == ("running", 1)
    assert plan.history[0]["new"]["requests"] == 12
    assert plan.step_baseline == {}  # the next step starts its own window


def test_a_failed_gate_rolls_back_and_a_later_tick_finishes_it(chat: Alias) -> None:
    plan = running()
    step = plan.step_generation or 0
    report("r", step)
    clock.rollouts_tick()
    report("r", step, v2=traffic(10, errors=5))
    assert clock.rollouts_tick() == 1
    plan.refresh_from_db()
    assert plan.state == "rolling_back" and "gate failed at step 1: error rate" in plan.reason
    assert Alias.objects.get(name="chat").targets == {"v1": 100}
    assert clock.rollouts_tick() == 0  # r has not reported from the restored weights yet
    report("r", RoutingGeneration.current())
    assert clock.rollouts_tick() == 1
    plan.refresh_from_db()
    assert plan.state == "rolled_back"


def test_a_due_plan_starts_on_the_tick(chat: Alias) -> None:
    start = timezone.now() + timedelta(minutes=5)
    request = plans.PlanRequest(alias="chat", to_target="v2", steps=STEPS, start_at=start)
    plan = plans.rollout_create(request=request, actor="ops")
    assert clock.rollouts_tick(start - timedelta(seconds=1)) == 0
    assert clock.rollouts_tick(start) == 1
    plan.refresh_from_db()
    assert plan.state == "running" and Alias.objects.get(name="chat").targets == {
        "v1": 90, "v2": 10,
    }  # fmt: skip
    assert plan.history == [] and plan.step_index == 0


def test_traffic_now_is_every_routers_totals(chat: Alias) -> None:
    report("a", 1, v1=traffic(3))
    report("b", 1)
    assert clock.traffic_now() == {"a": {"v1": traffic(3)}, "b": {}}
