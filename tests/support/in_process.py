"""The admin API and the console's pages called in this process, through Django's test
client: no server, the same middleware, URL routing, auth and error handlers."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth import get_user_model
from django.http import HttpResponse
from django.test import Client

from tests.support.common import ADMIN_HEADERS


def call(
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = ADMIN_HEADERS,
    raw: bytes | None = None,
) -> HttpResponse:
    """One API call, by default with the admin token; `raw` sends bytes as they are."""
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    return Client().generic(
        method, path, data=data or b"", content_type="application/json", headers=headers or {}
    )


def error_of(response: HttpResponse) -> dict[str, Any]:
    """The OpenAI error shape's `error` object, checking its shape on the way."""
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == response.status_code
    return error


def staff_client(username: str = "op", *, superuser: bool = True) -> Client:
    """A logged-in staff (by default superuser) browser session."""
    users = get_user_model().objects
    make = users.create_superuser if superuser else users.create_user
    extra = {} if superuser else {"is_staff": True}
    user = make(username, password="op-password-123", **extra)
    browser = Client()
    browser.force_login(user)
    return browser
