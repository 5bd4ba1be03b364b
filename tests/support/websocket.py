"""The dashboard's websocket (/ws/fleet/) in process, through Channels' WebsocketCommunicator,
with a logged-in user's session cookie."""

from __future__ import annotations

from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from controlpanel.asgi import application

HOST = "testserver"


def session_cookie(*, staff: bool) -> str:
    user = get_user_model().objects.create_user(
        f"user-{staff}", password="irrelevant-password-1", is_staff=staff
    )
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def communicator(cookie: str | None, origin: str = f"http://{HOST}") -> WebsocketCommunicator:
    headers = [(b"host", HOST.encode()), (b"origin", origin.encode())]
    if cookie:
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    return WebsocketCommunicator(application.channels, "/ws/fleet/", headers=headers)
