"""The routing dry run and the recent decisions: without a router in the process, a 503
that says where to ask; with one, its answer, with only the session and priority headers
passed on, and its refusals as 422 (a bad body) and 404 (an unknown model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from controlpanel.api import explain as endpoint
from tests.support.common import ADMIN_HEADERS
from tests.support.in_process import call, error_of

pytestmark = pytest.mark.django_db
DECISIONS = {"m": [{"worker": "w1", "decision": "least_loaded"}], "n": []}


class FakeRouter:
    """Stands in for the router of this process: records what the dry run was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], list[tuple[bytes, bytes]]]] = []

    def recent_decisions(self) -> dict[str, Any]:
        return DECISIONS


@pytest.fixture
def fake_router(monkeypatch: pytest.MonkeyPatch) -> FakeRouter:
    fake = FakeRouter()

    def dry_run(app: FakeRouter, payload: dict[str, Any], headers: Any) -> dict[str, Any]:
        app.seen.append((payload, list(headers)))
        if "model" not in payload:
            raise ValueError("the request body needs a `model`")
        if payload["model"] != "m":
            raise LookupError(f"The model `{payload['model']}` does not exist.")
        return {"decision": "least_loaded", "worker": "w1"}

    def on_router(read: Callable[[FakeRouter], Any]) -> Any:
        return read(fake)

    monkeypatch.setattr(endpoint.explain, "on_router", on_router)
    monkeypatch.setattr(endpoint.explain, "dry_run", dry_run)
    return fake


def test_without_a_router_in_the_process_it_says_where_to_ask() -> None:
    answer = call("POST", "/api/route/explain", {"model": "m"})
    assert answer.status_code == 503
    assert "ask a router's /api" in error_of(answer)["message"]
    assert call("GET", "/api/route/decisions").json() == {}


def test_the_dry_run_gets_only_the_session_and_priority_headers(fake_router: FakeRouter) -> None:
    headers = {**ADMIN_HEADERS, "X-Priority": "critical", "X-Other": "dropped"}
    answer = call("POST", "/api/route/explain", {"model": "m"}, headers=headers)
    assert answer.status_code == 200
    assert answer.json() == {"decision": "least_loaded", "worker": "w1"}
    ((payload, passed),) = fake_router.seen
    assert payload == {"model": "m"}
    assert (b"x-priority", b"critical") in passed
    assert all(name not in {b"x-other", b"authorization"} for name, _ in passed)


def test_a_bad_body_is_a_422_and_an_unknown_model_a_404(fake_router: FakeRouter) -> None:
    bad = call("POST", "/api/route/explain", {"messages": []})
    assert bad.status_code == 422
    assert error_of(bad)["message"] == "the request body needs a `model`"
    unknown = call("POST", "/api/route/explain", {"model": "nope"})
    assert unknown.status_code == 404
    assert "`nope`" in error_of(unknown)["message"]
    assert call("POST", "/api/route/explain", ["not", "an", "object"]).status_code == 422


def test_decisions_are_every_models_or_one_asked_for(fake_router: FakeRouter) -> None:
    assert call("GET", "/api/route/decisions").json() == DECISIONS
    assert call("GET", "/api/route/decisions?model=m").json() == {"m": DECISIONS["m"]}
    assert call("GET", "/api/route/decisions?model=zzz").json() == {"zzz": []}
    assert call("GET", "/api/route/decisions", headers=None).status_code == 401
