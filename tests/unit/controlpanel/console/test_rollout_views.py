"""The rollouts pages: the steps and targets text parsed (a bad line named), an alias
created and reweighted, a plan created from the form (a refused one kept as typed), its
page and actions; nonsense in the form is a message, never a 500."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from controlpanel.console.rollout_views import parse_steps, parse_targets
from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import Alias, RolloutPlan, ServedModel, Worker
from tests.support.in_process import staff_client

pytestmark = pytest.mark.django_db


def serve(model: str) -> None:
    ServedModel.objects.get_or_create(name=model)
    Worker.objects.create(
        url=f"http://127.0.0.1:9/{model}", name=model, source=WorkerSource.OPERATOR,
        models=[{"id": model}], last_heartbeat=timezone.now(),
    )  # fmt: skip


def test_steps_read_a_weight_and_a_hold_in_seconds_minutes_or_hours() -> None:
    text = "5 10min\n\n25% 90\n 50 1.5h \n100 0"
    assert parse_steps(text) == [
        {"weight": 5, "hold_seconds": 600.0}, {"weight": 25, "hold_seconds": 90.0},
        {"weight": 50, "hold_seconds": 5400.0}, {"weight": 100, "hold_seconds": 0.0},
    ]  # fmt: skip
    for bad, line in (("5 10min\n25 10 days", 2), ("five 10min", 1), ("25 10min 3", 1)):
        with pytest.raises(ValueError, match=f"step line {line} "):
            parse_steps(bad)


def test_targets_read_name_equals_weight() -> None:
    assert parse_targets("org/a=90, b=10\nc = 0") == {"org/a": 90, "b": 10, "c": 0}
    assert parse_targets("") == {}
    for bad in ("a", "=5", "a=ninety", "a=-1"):
        with pytest.raises(ValueError, match="is not like `model-name=90`"):
            parse_targets(bad)


def test_an_alias_is_created_then_reweighted_and_a_bad_one_refused() -> None:
    serve("old")
    serve("new")
    browser = staff_client()
    made = browser.post("/aliases/save", {"name": "chat", "targets": "old=100"}, follow=True)
    assert "Created chat" in made.content.decode()
    browser.post("/aliases/save", {"name": "chat", "targets": "old=80, new=20"})
    assert Alias.objects.get(name="chat").targets == {"old": 80, "new": 20}
    bad = browser.post("/aliases/save", {"name": "chat", "targets": "old=lots"}, follow=True)
    assert "Alias chat not saved: `old=lots` is not like" in bad.content.decode()
    browser.post("/aliases/delete", {"name": "chat"})
    assert not Alias.objects.exists()


def form(**fields: Any) -> dict[str, Any]:
    return {"alias": "chat", "to_target": "new", "steps": "10 10min\n100 0", **fields}


def test_a_plan_from_the_form_starts_and_its_page_and_actions_work() -> None:
    serve("old")
    serve("new")
    Alias.objects.create(name="chat", targets={"old": 100})
    browser = staff_client()
    created = browser.post("/rollouts/new", form(max_error_rate="5"))
    plan = RolloutPlan.objects.get()
    assert created["Location"] == f"/rollouts/{plan.pk}/"
    assert plan.max_error_rate == pytest.approx(0.05)
    page = browser.get(f"/rollouts/{plan.pk}/").content.decode()
    assert "chat" in page and "new" in page
    paused = browser.post(f"/rollouts/{plan.pk}/pause", follow=True).content.decode()
    assert f"Rollout #{plan.pk} is paused" in paused
    again = browser.post(f"/rollouts/{plan.pk}/pause", follow=True).content.decode()
    assert "it cannot pause" in again
    missing = browser.get("/rollouts/424242/", follow=True)
    assert missing.redirect_chain[-1][0] == "/rollouts/"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"steps": "ten 10min"}, "step line 1"),
        ({"min_requests": "many"}, "Plan not created"),
        ({"max_error_rate": "nan"}, "max_error_rate is a fraction"),
        ({"start_at": "tomorrow"}, "Plan not created"),
        ({"min_requests": "9" * 30}, "min_requests is at most 2147483647"),
        ({"to_target": "old"}, "must differ"),
    ],
)
def test_a_refused_plan_says_why_and_keeps_the_form(fields: dict[str, str], says: str) -> None:
    serve("old")
    serve("new")
    Alias.objects.create(name="chat", targets={"old": 100})
    browser = staff_client()
    page = browser.post("/rollouts/new", form(**fields), follow=True)
    assert page.status_code == 200
    text = page.content.decode()
    assert says in text
    assert fields.get("steps", "10 10min") in text  # the steps come back as typed
    assert not RolloutPlan.objects.exists()
