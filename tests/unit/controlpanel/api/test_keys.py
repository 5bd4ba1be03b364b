"""The admin's key endpoints: a key is shown once, by the POST that makes it; PATCH changes
only what is sent and refuses a null where none may be (naming the field as sent); revoke;
usage per key and model, from a day or ever."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from controlpanel.registry.models import ApiKey, KeyUsage, ServedModel
from tests.support.in_process import call, error_of

pytestmark = pytest.mark.django_db


def create(**fields: Any) -> dict[str, Any]:
    answer = call("POST", "/api/keys", {"name": "team-a", **fields})
    assert answer.status_code == 201, answer.content
    body: dict[str, Any] = answer.json()
    return body


def test_the_key_is_shown_once_and_then_only_its_prefix() -> None:
    ServedModel.objects.create(name="m")
    issued = create(models=["m"], rpm=60, daily_tokens=1000)
    secret, prefix = issued["key"], issued["prefix"]
    assert secret.startswith(prefix) and len(secret) > len(prefix)
    assert issued["budgets"]["daily"]["limit"] == 1000 and issued["budgets"]["daily"]["used"] == 0
    listed = call("GET", "/api/keys")
    assert secret not in listed.content.decode()
    (shown,) = listed.json()
    assert "key" not in shown
    assert (shown["prefix"], shown["models"], shown["rpm"]) == (prefix, ["m"], 60)
    assert shown["unknown_models"] == []


def test_an_unknown_model_is_refused_unless_accepted_on_purpose() -> None:
    refused = call("POST", "/api/keys", {"name": "k", "models": ["not-yet"]})
    assert refused.status_code == 422
    assert "allow_unknown_models" in error_of(refused)["message"]
    assert not ApiKey.objects.exists()
    kept = create(models=["not-yet"], allow_unknown_models=True)
    assert kept["unknown_models"] == ["not-yet"]


@pytest.mark.parametrize(
    "body", [{"name": ""}, {"rpm": 0}, {"priority": "vip"}, {"weight": 0}, {"daily_tokens": 2**63}]
)
def test_bad_settings_are_refused_in_the_error_shape(body: dict[str, Any]) -> None:
    answer = call("POST", "/api/keys", {"name": "k", **body})
    assert 400 <= answer.status_code < 500
    error_of(answer)
    assert not ApiKey.objects.exists()


def test_a_patch_changes_only_what_is_sent_and_null_removes_a_limit() -> None:
    key_id = create(rpm=60, tpm=1000)["id"]
    answer = call("PATCH", f"/api/keys/{key_id}", {"rpm": None, "explain": True})
    assert answer.status_code == 200, answer.content
    shown = answer.json()
    assert (shown["rpm"], shown["tpm"], shown["explain"]) == (None, 1000, True)


@pytest.mark.parametrize("field", ["name", "models", "explain", "priority", "weight"])
def test_a_null_where_none_may_be_names_the_field_as_sent(field: str) -> None:
    key_id = create()["id"]
    answer = call("PATCH", f"/api/keys/{key_id}", {field: None})
    assert answer.status_code == 422
    assert error_of(answer)["message"] == f"`{field}` cannot be null"


def test_an_empty_patch_and_an_unknown_key_are_refused() -> None:
    key_id = create()["id"]
    empty = call("PATCH", f"/api/keys/{key_id}", {"allow_unknown_models": True})
    assert empty.status_code == 422
    assert error_of(empty)["message"].startswith("send at least one of name, models")
    assert call("PATCH", "/api/keys/424242", {"rpm": 5}).status_code == 404


def test_revoking_keeps_the_row_and_a_revoked_key_cannot_change() -> None:
    key_id = create()["id"]
    revoked = call("DELETE", f"/api/keys/{key_id}")
    assert revoked.status_code == 204
    assert ApiKey.objects.get(pk=key_id).revoked_at is not None
    assert call("DELETE", f"/api/keys/{key_id}").status_code == 204  # idempotent
    assert "revoked" in error_of(call("PATCH", f"/api/keys/{key_id}", {"rpm": 5}))["message"]
    assert call("DELETE", "/api/keys/424242").status_code == 404


def test_usage_sums_per_key_and_model_from_a_day_or_ever() -> None:
    key = ApiKey.objects.get(pk=create()["id"])
    today = dt.date(2026, 3, 10)
    for day, requests in ((today, 2), (today - dt.timedelta(days=3), 5)):
        KeyUsage.objects.create(
            api_key=key, model="m", day=day, requests=requests,
            prompt_tokens=10 * requests, completion_tokens=requests,
        )  # fmt: skip
    (ever,) = call("GET", "/api/usage").json()
    assert (ever["key_name"], ever["requests"], ever["total_tokens"]) == ("team-a", 7, 77)
    (recent,) = call("GET", f"/api/usage?since={today.isoformat()}").json()
    assert (recent["requests"], recent["prompt_tokens"]) == (2, 20)
    assert call("GET", "/api/usage?since=yesterday").status_code == 422
