"""The admin's alias and rollout endpoints: aliases with the healthy workers of each target
(a name may hold a slash), a plan that starts at once only when its pre-flight passes (a
409 with the reasons, keeping nothing), a scheduled one showing why it could not start
now, and the plan's actions with their refusals."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import Alias, RolloutPlan, ServedModel, Worker
from tests.support.in_process import call, error_of

pytestmark = pytest.mark.django_db
STEPS = [{"weight": 10, "hold_seconds": 600}, {"weight": 100, "hold_seconds": 0}]


def serve(model: str) -> None:
    ServedModel.objects.get_or_create(name=model)
    Worker.objects.create(
        url=f"http://127.0.0.1:9/{model}", name=model, source=WorkerSource.OPERATOR,
        models=[{"id": model}], last_heartbeat=timezone.now(),
    )  # fmt: skip


def alias(name: str = "team/chat", targets: dict[str, int] | None = None) -> dict[str, Any]:
    answer = call("POST", "/api/aliases", {"name": name, "targets": targets or {"old": 100}})
    assert answer.status_code == 201, answer.content
    body: dict[str, Any] = answer.json()
    return body


def plan(**fields: Any) -> Any:
    return call("POST", "/api/rollouts", {"alias": "team/chat", "to_target": "new",
                                          "steps": STEPS, **fields})  # fmt: skip


def test_an_alias_shows_its_targets_healthy_workers_and_changes() -> None:
    serve("old")
    ServedModel.objects.create(name="spare")
    created = alias()
    assert created["healthy_workers"] == {"old": 1} and created["active_rollout"] is None
    patched = call("PATCH", "/api/aliases/team/chat", {"targets": {"old": 50, "spare": 50}})
    assert patched.status_code == 200
    assert patched.json()["healthy_workers"] == {"old": 1, "spare": 0}
    assert call("GET", "/api/aliases/team/chat").json()["targets"] == {"old": 50, "spare": 50}
    assert [a["name"] for a in call("GET", "/api/aliases").json()] == ["team/chat"]
    assert call("DELETE", "/api/aliases/team/chat").status_code == 204
    missing = call("GET", "/api/aliases/team/chat")
    assert missing.status_code == 404 and "team/chat" in error_of(missing)["message"]


def test_a_plan_whose_target_has_no_healthy_worker_is_a_409_that_keeps_nothing() -> None:
    serve("old")
    ServedModel.objects.create(name="new")
    alias()
    refused = plan()
    assert refused.status_code == 409
    assert "no healthy worker serves `new`" in error_of(refused)["message"]
    assert not RolloutPlan.objects.exists()
    assert Alias.objects.get().targets == {"old": 100}


def test_a_plan_starts_at_its_first_step_and_takes_its_actions() -> None:
    serve("old")
    serve("new")
    alias()
    started = plan()
    assert started.status_code == 201, started.content
    shown = started.json()
    assert (shown["from_target"], shown["step"], shown["weight"]) == ("old", 1, 10)
    assert 0 < shown["hold_left_s"] <= 600
    assert Alias.objects.get().targets == {"old": 90, "new": 10}
    assert call("GET", "/api/aliases/team/chat").json()["active_rollout"] == shown["id"]
    paused = call("POST", f"/api/rollouts/{shown['id']}/pause").json()
    assert paused["state"] == "paused"
    again = call("POST", f"/api/rollouts/{shown['id']}/pause")
    assert again.status_code == 409
    assert error_of(again)["message"] == f"rollout #{shown['id']} is paused: it cannot pause"
    rolled = call("POST", f"/api/rollouts/{shown['id']}/rollback")
    assert rolled.status_code == 200
    assert Alias.objects.get().targets == {"old": 100}


def test_a_scheduled_plan_waits_and_says_why_it_could_not_start_now() -> None:
    serve("old")
    ServedModel.objects.create(name="new")
    alias()
    later = (timezone.now() + dt.timedelta(hours=1)).isoformat()
    scheduled = plan(start_at=later)
    assert scheduled.status_code == 201, scheduled.content
    shown = scheduled.json()
    assert (shown["state"], shown["step"], shown["weight"]) == ("scheduled", None, None)
    assert shown["preflight"] == ["no healthy worker serves `new`"]
    listed = call("GET", "/api/rollouts?state=scheduled&alias=team/chat").json()
    assert [p["id"] for p in listed] == [shown["id"]]
    assert call("GET", "/api/rollouts?state=running").json() == []


@pytest.mark.parametrize(
    "body",
    [
        {"steps": []},
        {"steps": [{"weight": 101, "hold_seconds": 0}]},
        {"gates": {"max_error_rate": 2}},
        {"gates": {"max_ttft_p95_ratio": 0.5}},
        {"to_target": ""},
        {"to_target": "old"},
    ],
)
def test_a_bad_plan_is_refused_in_the_error_shape(body: dict[str, Any]) -> None:
    serve("old")
    serve("new")
    alias()
    answer = plan(**body)
    assert 400 <= answer.status_code < 500, answer.content
    error_of(answer)
    assert not RolloutPlan.objects.exists()


def test_unknown_plans_and_actions_are_refused() -> None:
    assert call("GET", "/api/rollouts/424242").status_code == 404
    assert call("POST", "/api/rollouts/424242/pause").status_code == 404
    assert call("POST", "/api/rollouts/1/explode").status_code == 422
