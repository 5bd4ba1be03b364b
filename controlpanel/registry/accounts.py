"""People and credentials: the first-run admin, and who an actor is in the event log."""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.http import HttpRequest

ADMIN_TOKEN_ACTOR = "admin-token"


def admin_bootstrap() -> str | None:
    """On a first run with no staff user, make `admin` with a random password and return
    the password (the caller prints it once); otherwise return None."""
    user_model = get_user_model()
    if user_model.objects.filter(is_staff=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    user_model.objects.create_superuser(username="admin", email="", password=password)
    return password


def request_actor(request: HttpRequest, *, surface: str = "user") -> str:
    """Who made a change, as the event log names them: a logged-in user (`user:NAME`, or
    `admin:NAME` from Django admin's forms), else the holder of the admin token (the API's
    other credential)."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"{surface}:{user.get_username()}"
    return ADMIN_TOKEN_ACTOR
