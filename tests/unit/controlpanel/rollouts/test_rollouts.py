"""The rollout state machine, its gates and the alias/rollout admin API, on the database
alone: router traffic is written into RouterInstance rows as routers report it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlpanel.registry.choices import EventKind
from controlpanel.registry.errors import InvalidTransition
from controlpanel.registry.models import Alias, Event, RolloutPlan, RouterInstance, Worker
from controlpanel.rollouts import aliases, clock, gates, plans, transitions
from routing.telemetry.counters import GATE_TTFT_BUCKETS
from tests.support.common import ADMIN_HEADERS
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db

STEPS = ({"weight": 10, "hold_seconds": 60}, {"weight": 100, "hold_seconds": 0})


@pytest.fixture
def fleet() -> None:
    # Only this test's reports: the session's router (when a test before this one started it)
    # reports into the same database, and the rollback would wait for it.
    routers_only_this_tests()
    for i, model in enumerate(("v1", "v1", "v2")):
        Worker.objects.create(
            url=f"http://10.0.0.{i}:8000",
            name=f"w{i}",
            source="operator",
            models=[{"id": model}],
        )
    aliases.alias_create(name="chat", targets={"v1": 100}, actor="test")


def plan_now(**changes: Any) -> RolloutPlan:
    request = plans.PlanRequest(
        alias="chat", to_target="v2", steps=STEPS, min_requests=20, **changes
    )
    return plans.rollout_create(request=request, actor="test")


def report(instance: str, generation: int, **models: tuple[int, int, float]) -> None:
    """A router's report: per model (requests, errors, every request's TTFT in seconds)."""
    traffic = {}
    for model, (requests, errors, ttft) in models.items():
        counts = [0] * (len(GATE_TTFT_BUCKETS) + 1)
        counts[sum(1 for b in GATE_TTFT_BUCKETS if b < ttft)] = requests - errors
        traffic[model] = {"requests": requests, "errors": errors, "ttft": counts}
    now = timezone.now()
    RouterInstance.objects.update_or_create(
        instance_id=instance,
        defaults={
            "hostname": "h",
            "pid": 1,
            "started_at": now,
            "last_seen": now,
            "generation": generation,
            "traffic": traffic,
        },
    )


def generation() -> int:
    from controlpanel.registry.models import RoutingGeneration

    return RoutingGeneration.current()


def test_a_plan_starts_at_its_first_step(fleet: None) -> None:
    plan = plan_now()
    assert plan.state == "running" and plan.step_index == 0
    assert Alias.objects.get(name="chat").targets == {"v1": 90, "v2": 10}
    assert plan.original_targets == {"v1": 100}
    assert 59 < (plan.hold_left() or 0) <= 60


def test_preflight_refuses_a_target_without_healthy_workers(fleet: None) -> None:
    Worker.objects.filter(name="w2").update(state="unhealthy")
    with pytest.raises(plans.PreflightFailed, match="no healthy worker serves `v2`"):
        plan_now()
    assert not RolloutPlan.objects.exists()
    assert not Event.objects.filter(kind=EventKind.ROLLOUT).exists()  # nothing half-made
    assert Alias.objects.get(name="chat").targets == {"v1": 100}


def test_one_running_plan_per_alias(fleet: None) -> None:
    plan_now()
    with pytest.raises(plans.PreflightFailed, match="is running on `chat`"):
        plan_now(from_target="v1")


def test_invalid_steps_are_refused() -> None:
    with pytest.raises(plans.InvalidPlan, match="rise"):
        plans.steps_clean([{"weight": 50}, {"weight": 20}, {"weight": 100}])
    with pytest.raises(plans.InvalidPlan, match="last step"):
        plans.steps_clean([{"weight": 50}])


def test_gates_pass_only_after_the_hold_and_enough_requests(fleet: None) -> None:
    plan = plan_now()
    report("r1", generation(), v1=(0, 0, 0.02), v2=(0, 0, 0.02))
    assert clock.rollouts_tick() == 0  # baseline taken now
    report("r1", generation(), v1=(200, 0, 0.02), v2=(25, 0, 0.021))
    later = timezone.now() + timedelta(seconds=61)
    assert clock.rollouts_tick(later) == 1
    plan.refresh_from_db()
    assert plan.step_index == 1 and plan.history[0]["new"]["requests"] == 25
    assert plan.reference_ttft_p95 is not None


def test_an_error_gate_rolls_back_at_once(fleet: None) -> None:
    plan = plan_now()
    report("r1", generation(), v1=(0, 0, 0.02), v2=(0, 0, 0.02))
    clock.rollouts_tick()
    report("r1", generation(), v1=(200, 0, 0.02), v2=(30, 6, 0.02))
    clock.rollouts_tick()
    plan.refresh_from_db()
    # No live router lags behind the rollback's generation... except r1, which reported an
    # older one: the plan waits in rolling_back until it routes with the old weights.
    assert plan.state == "rolling_back"
    assert "error rate 20.0%" in plan.reason
    assert Alias.objects.get(name="chat").targets == {"v1": 100}
    # Only r1: a router process another test left running writes its life sign into this
    # flushed database too, with an older generation, and would hold the plan back.
    RouterInstance.objects.exclude(instance_id="r1").delete()
    report("r1", generation(), v1=(200, 0, 0.02), v2=(30, 6, 0.02))
    clock.rollouts_tick()
    plan.refresh_from_db()
    assert plan.state == "rolled_back"
    event = Event.objects.filter(kind=EventKind.ROLLOUT, data__to="rolling_back").get()
    assert event.actor == "gate"


def test_a_slow_new_version_fails_the_latency_gate(fleet: None) -> None:
    plan = plan_now()
    report("r1", generation(), v1=(0, 0, 0.02), v2=(0, 0, 0.02))
    clock.rollouts_tick()
    report("r1", generation(), v1=(200, 0, 0.02), v2=(30, 0, 0.2))
    clock.rollouts_tick()
    plan.refresh_from_db()
    assert plan.state in ("rolling_back", "rolled_back")
    assert "time to first token" in plan.reason


def test_traffic_before_a_router_applies_the_step_is_not_counted(fleet: None) -> None:
    plan_now()
    report("r1", generation() - 1, v2=(50, 50, 0.02))  # still on the old snapshot
    clock.rollouts_tick()
    report("r1", generation(), v2=(50, 50, 0.02))  # now routing with the step's weights
    clock.rollouts_tick()
    plan = RolloutPlan.objects.get()
    assert plan.state == "running"
    assert plan.last_check["new"]["requests"] == 0


def test_pause_keeps_the_remaining_hold(fleet: None) -> None:
    plan = plan_now()
    RolloutPlan.objects.filter(pk=plan.pk).update(
        step_started_at=timezone.now() - timedelta(seconds=45)
    )
    plan = transitions.rollout_action(plan_id=plan.pk, action="pause", actor="test")
    assert plan.state == "paused" and 14 < (plan.paused_remaining or 0) <= 15
    assert clock.rollouts_tick(timezone.now() + timedelta(hours=1)) == 0  # paused: no clock
    plan = transitions.rollout_action(plan_id=plan.pk, action="resume", actor="test")
    assert plan.state == "running" and 14 < (plan.hold_left() or 0) <= 15


def test_illegal_transitions_are_refused(fleet: None) -> None:
    plan = plan_now()
    with pytest.raises(InvalidTransition, match="cannot resume"):
        transitions.rollout_action(plan_id=plan.pk, action="resume", actor="test")
    transitions.rollout_action(plan_id=plan.pk, action="advance", actor="test")
    plan = transitions.rollout_action(plan_id=plan.pk, action="advance", actor="test")
    assert plan.state == "completed"
    for action in transitions.ACTIONS:
        with pytest.raises(InvalidTransition):
            transitions.rollout_action(plan_id=plan.pk, action=action, actor="test")


def test_two_workers_cannot_both_claim_a_step(fleet: None) -> None:
    plan = plan_now()
    stale = RolloutPlan.objects.get(pk=plan.pk)
    transitions.rollout_action(plan_id=plan.pk, action="advance", actor="worker-1")
    with pytest.raises(InvalidTransition, match="changed meanwhile"):
        transitions.next_step(stale, "worker-2", "duplicate")
    assert RolloutPlan.objects.get(pk=plan.pk).step_index == 1


def test_abort_holds_the_weights_and_rollback_restores_them(fleet: None) -> None:
    plan = plan_now()
    plan = transitions.rollout_action(plan_id=plan.pk, action="abort", actor="test")
    assert plan.state == "aborted"
    assert Alias.objects.get(name="chat").targets == {"v1": 90, "v2": 10}
    plan = transitions.rollout_action(plan_id=plan.pk, action="rollback", actor="test")
    assert plan.state == "rolled_back"  # no live router to wait for
    assert Alias.objects.get(name="chat").targets == {"v1": 100}


def test_completion_drains_the_old_workers(fleet: None) -> None:
    plan = plan_now(drain_old=True)
    transitions.rollout_action(plan_id=plan.pk, action="advance", actor="test")
    plan = transitions.rollout_action(plan_id=plan.pk, action="advance", actor="test")
    assert plan.state == "completed"
    assert Alias.objects.get(name="chat").targets == {"v2": 100}
    states = dict(Worker.objects.values_list("name", "state"))
    assert states["w2"] == "active" and {states["w0"], states["w1"]} <= {"draining", "drained"}


def test_a_scheduled_plan_waits_then_checks_again(fleet: None) -> None:
    start = timezone.now() + timedelta(minutes=5)
    plan = plan_now(start_at=start)
    assert plan.state == "scheduled"
    assert clock.rollouts_tick() == 0
    Worker.objects.filter(name="w2").update(state="drained")
    clock.rollouts_tick(start + timedelta(seconds=1))
    plan.refresh_from_db()
    assert plan.state == "aborted" and "no healthy worker" in plan.reason


def test_quantile_interpolates_within_a_bucket() -> None:
    counts = [0] * (len(GATE_TTFT_BUCKETS) + 1)
    counts[10] = 100
    p95 = gates.quantile(counts, 0.95)
    assert p95 is not None and GATE_TTFT_BUCKETS[9] < p95 <= GATE_TTFT_BUCKETS[10]
    assert gates.quantile([0] * len(counts), 0.95) is None


# --- the admin API ---------------------------------------------------------------------------


def api(method: str, path: str, body: Any = None) -> tuple[int, Any]:
    client = Client()
    call = getattr(client, method)
    kwargs = {"data": body, "content_type": "application/json"} if body is not None else {}
    response = call(f"/api{path}", headers=ADMIN_HEADERS, **kwargs)
    return response.status_code, response.json() if response.content else None


def test_alias_api_round_trip(fleet: None) -> None:
    status, body = api("post", "/aliases", {"name": "code", "targets": {"v1": 3, "v2": 1}})
    assert status == 201 and body["healthy_workers"] == {"v1": 2, "v2": 1}
    assert api("patch", "/aliases/code", {"targets": {"v2": 1}})[1]["targets"] == {"v2": 1}
    assert api("get", "/aliases")[0] == 200
    assert api("delete", "/aliases/code")[0] == 204
    assert api("get", "/aliases/code")[0] == 404


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"name": "chat", "targets": {"v1": 1}}, 409, "exists"),
        ({"name": "x", "targets": {}}, 422, "non-empty"),
        ({"name": "x", "targets": {"v1": 0}}, 422, "above 0"),
        ({"name": "x", "targets": {"v1": -1}}, 422, "0 to 10000"),
        ({"name": " ", "targets": {"v1": 1}}, 422, "alias name"),
        ({"name": "x", "targets": {"x": 1}}, 422, "its own target"),
        ({"name": "x", "targets": "v1"}, 422, "targets"),
    ],
)
def test_alias_api_refuses_bad_input(fleet: None, body: Any, status: int, words: str) -> None:
    got, answer = api("post", "/aliases", body)
    assert got == status
    assert words in answer["error"]["message"]


def test_rollout_api(fleet: None) -> None:
    status, plan = api("post", "/rollouts", {"alias": "chat", "to_target": "v2"})
    assert status == 201 and plan["state"] == "running" and plan["weight"] == 5
    assert [s["weight"] for s in plan["steps"]] == [5, 25, 50, 100]  # the default steps
    assert api("patch", "/aliases/chat", {"targets": {"v1": 1}})[0] == 409
    status, paused = api("post", f"/rollouts/{plan['id']}/pause")
    assert status == 200 and paused["state"] == "paused"
    status, error = api("post", f"/rollouts/{plan['id']}/pause")
    assert status == 409 and "cannot pause" in error["error"]["message"]
    assert api("post", f"/rollouts/{plan['id']}/explode")[0] == 422
    assert api("get", "/rollouts/999")[0] == 404
    status, error = api("post", "/rollouts", {"alias": "chat", "to_target": "v2", "steps": []})
    assert status == 422
    assert api("get", "/rollouts?state=paused")[1][0]["id"] == plan["id"]


def test_rollout_api_preflight_answer(fleet: None) -> None:
    status, error = api("post", "/rollouts", {"alias": "chat", "to_target": "v9"})
    assert status == 409
    assert "no healthy worker serves `v9`" in error["error"]["message"]
