"""The API's error handlers: every failure is the OpenAI error shape with the right status,
a field path without ninja's `body.payload`, a hint naming the credential to send, a 503
with Retry-After for the database (even wrapped), a logged 500 for a bug; unknown /api/
paths are JSON too."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from controlpanel.fleet import selectors
from controlpanel.registry.models import Alias, ServedModel
from tests.support.in_process import call, error_of

pytestmark = pytest.mark.django_db


def test_missing_objects_are_404s_in_the_error_shape() -> None:
    worker = error_of(call("GET", "/api/workers/999999"))
    assert (worker["code"], worker["type"]) == (404, "NotFoundError")
    assert worker["message"] == "no such worker; register again"
    assert error_of(call("GET", "/api/models/nope"))["message"] == "no such model"
    route = call("GET", "/api/no/such/route")
    assert route.status_code == 404 and route["Content-Type"] == "application/json"
    assert "no route /api/no/such/route" in error_of(route)["message"]


def test_a_service_refusal_keeps_its_status_and_class_name() -> None:
    ServedModel.objects.create(name="m")
    Alias.objects.create(name="chat", targets={"m": 100})
    answer = call("POST", "/api/aliases", {"name": "chat", "targets": {"m": 100}})
    assert 400 <= answer.status_code < 500
    error = error_of(answer)
    assert error["type"] not in {"HttpError", "InternalServerError"}
    assert "chat" in error["message"]


def test_a_validation_error_names_the_fields_path_in_the_body() -> None:
    ServedModel.objects.create(name="m")
    Alias.objects.create(name="chat", targets={"m": 100})
    body = {"alias": "chat", "to_target": "m", "steps": [{"weight": 0, "hold_seconds": 1}]}
    answer = call("POST", "/api/rollouts", body)
    assert answer.status_code == 422
    error = error_of(answer)
    assert error["type"] == "ValidationError"
    assert error["message"].startswith("invalid request: steps.0.weight: ")
    assert "body" not in error["message"] and "payload" not in error["message"]


def test_a_body_that_is_not_json_is_a_4xx_in_the_error_shape() -> None:
    answer = call("POST", "/api/keys", raw=b"{not json")
    assert 400 <= answer.status_code < 500
    error_of(answer)


@pytest.mark.parametrize(
    ("method", "path", "setting", "expected"),
    [
        ("GET", "/api/workers", "", "send Authorization: Bearer $CONTROLPANEL_ADMIN_TOKEN"),
        ("GET", "/api/workers", "CONTROLPANEL_ADMIN_TOKEN", "log in as staff (the server has no"),
        ("POST", "/api/workers/1/heartbeat", "", "Bearer $CONTROLPANEL_WORKER_TOKEN"),
        ("POST", "/api/workers/1/deregister", "CONTROLPANEL_WORKER_TOKEN", "agent calls are"),
    ],
)
def test_the_401_says_which_credential_to_send(
    settings: pytest.FixtureRequest, method: str, path: str, setting: str, expected: str
) -> None:
    if setting:
        setattr(settings, setting, "")
    answer = call(method, path, {}, headers=None)
    assert answer.status_code == 401
    assert expected in error_of(answer)["message"]


def test_a_database_failure_is_a_503_with_retry_after_even_when_wrapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def down() -> None:
        raise OperationalError("connection refused")

    def wrapped() -> None:
        try:
            down()
        except OperationalError as exc:
            raise RuntimeError("while resolving") from exc

    for failure in (down, wrapped):
        monkeypatch.setattr(selectors, "workers_by_model", failure)
        answer = call("GET", "/api/models")
        assert answer.status_code == 503
        assert answer["Retry-After"] == "5"
        assert error_of(answer)["type"] == "DatabaseError"


def test_a_bug_is_a_logged_500_in_the_error_shape(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise KeyError("oops")

    monkeypatch.setattr(selectors, "workers_by_model", broken)
    answer = call("GET", "/api/models")
    assert answer.status_code == 500
    error = error_of(answer)
    assert error["type"] == "InternalServerError"
    assert error["message"] == "internal error; see the server log"
    assert "admin API GET /api/models failed" in caplog.text
