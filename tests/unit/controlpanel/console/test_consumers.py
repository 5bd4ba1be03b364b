"""The dashboard websocket, driven with Channels' WebsocketCommunicator: who it refuses.
Going live with a fleet's changes: tests/e2e/test_consumers.py."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from tests.support.websocket import communicator, session_cookie

pytestmark = pytest.mark.django_db(transaction=True)


async def refused(comm: WebsocketCommunicator) -> Any:
    connected, code = await comm.connect()
    await comm.disconnect()
    return connected, code


def test_anonymous_users_are_refused() -> None:
    assert async_to_sync(refused)(communicator(None)) == (False, 4401)


def test_non_staff_users_are_refused() -> None:
    cookie = session_cookie(staff=False)
    assert async_to_sync(refused)(communicator(cookie)) == (False, 4401)


def test_foreign_origins_are_refused() -> None:
    cookie = session_cookie(staff=True)
    assert async_to_sync(refused)(communicator(cookie, "http://evil.example")) == (False, 4403)
