"""A bug on one of the router's listing routes, in process: the client still gets an answer
in the OpenAI error shape with its request id, and the router keeps serving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from routing import listings
from routing.router import RouterApp

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_bug_on_a_listing_route_is_a_json_500_with_the_request_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection in-process: the listing raises. The client still gets an answer in
    the OpenAI error shape carrying its request id, and the router keeps serving."""
    app = RouterApp()

    def broken(*_: object) -> list[dict[str, object]]:
        raise RuntimeError("injected")

    monkeypatch.setattr(listings, "worker_listing", broken)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/list_workers",
        "headers": [(b"x-request-id", b"bug-1")],
        "query_string": b"",
    }
    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 500
    assert (b"x-request-id", b"bug-1") in start["headers"]
    error = json.loads(body)["error"]
    assert error["code"] == 500 and "bug-1" in error["message"]
    sent.clear()
    asyncio.run(app({**scope, "path": "/health", "headers": []}, receive, send))
    assert sent[0]["status"] == 200
