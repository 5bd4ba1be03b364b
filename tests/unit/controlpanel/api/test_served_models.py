"""The admin's model endpoints: list and get with the workers serving each (a name may hold
a slash), PATCH of the policy, limit, preflight, reserve, fallbacks, tokenizer and PD
bypass, and a refused PATCH that changes nothing at all."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import Event, ServedModel, Worker
from routing.policies import POLICIES
from tests.support.in_process import call, error_of

pytestmark = pytest.mark.django_db
NAME = "org/model-7b"


@pytest.fixture
def model() -> ServedModel:
    served = ServedModel.objects.create(name=NAME)
    Worker.objects.create(
        url="http://127.0.0.1:9", name="w", source=WorkerSource.OPERATOR, models=[{"id": NAME}]
    )
    return served


def test_list_and_get_show_each_models_workers(model: ServedModel) -> None:
    ServedModel.objects.create(name="idle")
    listed = {m["name"]: m for m in call("GET", "/api/models").json()}
    worker_id = Worker.objects.get().pk
    assert listed[NAME]["workers"] == [worker_id] and listed["idle"]["workers"] == []
    one = call("GET", f"/api/models/{NAME}")
    assert one.status_code == 200
    assert (one.json()["name"], one.json()["workers"]) == (NAME, [worker_id])


def test_the_policies_are_listed_sorted() -> None:
    assert call("GET", "/api/policies").json() == sorted(POLICIES)


def test_a_patch_sets_several_settings_at_once(model: ServedModel) -> None:
    body = {"policy": "round_robin", "max_inflight": 8, "preflight": "refuse",
            "priority_reserve": 0.25, "pd_bypass_tokens": 64}  # fmt: skip
    answer = call("PATCH", f"/api/models/{NAME}", body)
    assert answer.status_code == 200, answer.content
    shown = answer.json()
    assert {k: shown[k] for k in body} == body
    saved = ServedModel.objects.get(name=NAME)
    assert (saved.policy, saved.max_inflight, saved.preflight) == ("round_robin", 8, "refuse")
    assert Event.objects.filter(kind="policy_changed").exists()


def test_an_empty_patch_says_what_to_send(model: ServedModel) -> None:
    answer = call("PATCH", f"/api/models/{NAME}", {})
    assert answer.status_code == 422
    assert "send `policy`" in error_of(answer)["message"]
    assert call("PATCH", "/api/models/nope", {"max_inflight": 1}).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"policy": "fastest"},
        {"policy": "round_robin", "policy_config": {"no_such_knob": 1}},
        {"max_inflight": -1},
        {"preflight": "ignore"},
        {"priority_reserve": 1.0},
        {"fallbacks": ["no-such-model"]},
        {"fallbacks": [NAME]},
        {"tokenizer": "/nonexistent/tokenizer-folder"},
    ],
)
def test_a_bad_setting_is_a_4xx_in_the_error_shape(
    model: ServedModel, body: dict[str, Any]
) -> None:
    before = ServedModel.objects.filter(name=NAME).values().get()
    answer = call("PATCH", f"/api/models/{NAME}", body)
    assert 400 <= answer.status_code < 500, answer.content
    error_of(answer)
    assert ServedModel.objects.filter(name=NAME).values().get() == before


@pytest.mark.parametrize(
    "body",
    [
        {"policy": "round_robin", "priority_reserve": 1.5},
        {"max_inflight": 4, "pd_bypass_tokens": 10**12},
        {"fallbacks": [], "tokenizer": "/nonexistent/tokenizer-folder"},
        {"policy": "round_robin", "preflight": "refuse", "priority_reserve": -0.5},
    ],
)
def test_a_patch_refused_on_one_setting_changes_none_of_the_others(
    model: ServedModel, body: dict[str, Any]
) -> None:
    """One request, one outcome: a 4xx leaves the model as it was, with no event."""
    ServedModel.objects.filter(name=NAME).update(fallbacks=["x"])
    before = ServedModel.objects.filter(name=NAME).values().get()
    answer = call("PATCH", f"/api/models/{NAME}", body)
    assert 400 <= answer.status_code < 500, answer.content
    assert ServedModel.objects.filter(name=NAME).values().get() == before
    assert not Event.objects.exists()
