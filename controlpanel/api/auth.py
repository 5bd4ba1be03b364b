"""Who may call the API: the admin token or a staff session for admin calls, the worker
token for agents."""

from __future__ import annotations

import secrets
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja.security import HttpBearer
from ninja.security.session import SessionAuthIsStaff


class _TokenBearer(HttpBearer):
    setting = ""

    def authenticate(self, request: HttpRequest, token: str) -> str | None:
        expected: str = getattr(settings, self.setting)
        if expected and secrets.compare_digest(token.encode(), expected.encode()):
            return self.setting
        return None


class AdminToken(_TokenBearer):
    setting = "CONTROLPANEL_ADMIN_TOKEN"


class WorkerToken(_TokenBearer):
    setting = "CONTROLPANEL_WORKER_TOKEN"


class StaffSession(SessionAuthIsStaff):
    """A logged-in staff browser; CSRF is checked only when a session cookie is present,
    so a caller with no credentials at all gets a 401 that says what to send, not a 403."""

    def _get_key(self, request: HttpRequest) -> str | None:
        if self.param_name not in request.COOKIES:
            return None
        return super()._get_key(request)


ADMIN_AUTH: list[Any] = [AdminToken(), StaffSession()]
AGENT_AUTH = [WorkerToken()]
