"""The admin API's input schemas refuse unknown fields (naming them) and NUL characters
anywhere in text (a 422, not the database's 503), changing nothing; the agents' schemas
stay lenient."""

from __future__ import annotations

import pytest

from controlpanel.registry.models import Alias, Event, ServedModel, Worker
from tests.support.common import AGENT_HEADERS
from tests.support.in_process import call, error_of

pytestmark = pytest.mark.django_db


def test_unknown_fields_are_named_and_nothing_changes() -> None:
    ServedModel.objects.create(name="m")
    answer = call("PATCH", "/api/models/m", {"policy": "round_robin", "modles": 1, "colour": 2})
    assert answer.status_code == 422
    error = error_of(answer)
    assert error["type"] == "UnknownFieldError"
    assert error["message"] == "unknown fields `modles`, `colour`: nothing was changed"
    assert ServedModel.objects.get(name="m").policy != "round_robin"
    one = error_of(call("POST", "/api/keys", {"name": "k", "rpmm": 3}))
    assert one["message"] == "unknown field `rpmm`: nothing was changed"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/aliases", {"name": "a\x00b", "targets": {"m": 100}}, "name"),
        ("/api/aliases", {"name": "ab", "targets": {"m\x00": 100}}, "targets"),
        ("/api/aliases", {"name": "ab", "targets": {"m": 1}, "fallbacks": ["x\x00"]}, "fallbacks"),
    ],
)
def test_a_nul_anywhere_in_text_is_a_422_naming_the_field(
    path: str, body: dict[str, object], field: str
) -> None:
    ServedModel.objects.create(name="m")
    answer = call("POST", path, body)
    assert answer.status_code == 422
    error = error_of(answer)
    assert error["type"] == "ValidationError"
    assert f"`{field}` contains a NUL character" in error["message"]
    assert not Alias.objects.exists() and not Event.objects.exists()


def test_a_nul_in_a_policy_configs_nested_strings_is_refused() -> None:
    ServedModel.objects.create(name="m")
    body = {"policy": "round_robin", "policy_config": {"deep": [{"k": "v\x00"}]}}
    answer = call("PATCH", "/api/models/m", body)
    assert answer.status_code == 422
    assert "`policy_config` contains a NUL" in error_of(answer)["message"]


def test_the_agents_schema_accepts_fields_of_a_newer_release() -> None:
    body = {"url": "http://127.0.0.1:9", "models": ["m"], "kv_events": "", "future": {"x": 1}}
    answer = call("POST", "/api/workers/register", body, headers=AGENT_HEADERS)
    assert answer.status_code == 200
    assert Worker.objects.get(pk=answer.json()["id"]).model_ids == ["m"]
