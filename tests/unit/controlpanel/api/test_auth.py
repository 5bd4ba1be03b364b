"""Who may call the API: the admin token or a staff session for admin calls, the worker
token for agents; a session's call is CSRF-checked, a call with no credentials is a 401."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlpanel.registry.models import Worker
from tests.support.common import ADMIN_HEADERS, AGENT_HEADERS
from tests.support.in_process import call, error_of, staff_client

pytestmark = pytest.mark.django_db


def test_each_token_opens_only_its_own_endpoints() -> None:
    assert call("GET", "/api/workers", headers=ADMIN_HEADERS).status_code == 200
    assert call("GET", "/api/workers", headers=AGENT_HEADERS).status_code == 401
    assert call("GET", "/api/workers", headers={"Authorization": "Bearer nope"}).status_code == 401
    register = {"url": "http://127.0.0.1:9", "models": ["m"], "kv_events": ""}
    assert call("POST", "/api/workers/register", register, headers=ADMIN_HEADERS).status_code == 401
    assert Worker.objects.count() == 0
    assert call("POST", "/api/workers/register", register, headers=AGENT_HEADERS).status_code == 200


def test_an_empty_token_setting_matches_no_bearer(settings: pytest.FixtureRequest) -> None:
    settings.CONTROLPANEL_WORKER_TOKEN = ""  # type: ignore[attr-defined]
    answer = call("POST", "/api/workers/1/heartbeat", {}, headers={"Authorization": "Bearer "})
    assert answer.status_code == 401
    assert "agent calls are disabled" in error_of(answer)["message"]


def test_a_staff_session_is_an_admin_and_a_plain_user_is_not() -> None:
    assert staff_client("root").get("/api/workers").status_code == 200
    assert staff_client("staffer", superuser=False).get("/api/workers").status_code == 200
    user = get_user_model().objects.create_user("plain", password="plain-password-1")
    browser = Client()
    browser.force_login(user)
    answer = browser.get("/api/workers")
    assert answer.status_code == 401
    assert error_of(answer)["type"] == "AuthenticationError"


def test_a_session_must_pass_csrf_but_no_credentials_at_all_is_a_401() -> None:
    user = get_user_model().objects.create_superuser("csrf-root", password="csrf-password-1")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    body = {"name": "k"}
    refused = browser.post("/api/keys", body, content_type="application/json")
    assert refused.status_code == 403
    assert "CSRF" in error_of(refused)["message"]
    anonymous = Client(enforce_csrf_checks=True).post(
        "/api/keys", body, content_type="application/json"
    )
    assert anonymous.status_code == 401
    assert "Authorization: Bearer $CONTROLPANEL_ADMIN_TOKEN" in error_of(anonymous)["message"]
