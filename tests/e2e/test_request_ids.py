"""Request IDs travel client -> router -> worker -> client, and each request leaves one JSON
access-log line without its prompt: model routes, and every other route of the router."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from routing.admission.auth import PREFIX_LENGTH
from tests.support.keyed import bearer, issue
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SECRET_PROMPT = "the-secret-prompt-text-42"
CHAT = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 2}


def forwarded_ids(sim: Any) -> list[str]:
    return [
        {k.lower(): v for k, v in r["headers"].items()}.get("x-request-id", "")
        for r in sim.state.requests
        if r["path"] == "/v1/chat/completions"
    ]


def access_lines(router: RouterServer, request_id: str) -> list[dict[str, Any]]:
    """The access-log lines of one request id. The router's log also holds uvicorn's and
    the control plane's own lines, which are not JSON and may contain the id's text."""
    found = []
    for line in router.log().splitlines():
        if line.startswith("{") and request_id in line:
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                found.append(entry)
    return found


def test_a_client_request_id_goes_upstream_and_comes_back(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim, name="gpu-rid")
    response = router.post("/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "req-7"})
    assert response.status_code == 200
    assert response.headers.get_list("x-request-id") == ["req-7"]
    assert forwarded_ids(sim) == ["req-7"]
    assert response.json()["id"].endswith("req-7")  # vLLM names its request after it

    [line] = wait_until(lambda: access_lines(router, "req-7"))
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert line["model"] == "m" and line["worker"] == "gpu-rid" and line["status"] == 200
    assert line["duration_ms"] > 0 and line["ttft_ms"] is not None and line["key"] is None
    assert SECRET_PROMPT not in router.log()


def test_a_missing_or_unusable_request_id_is_replaced_by_a_new_one(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    plain = router.post("/v1/chat/completions", json=CHAT)
    made = plain.headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    for unusable in ("x" * 500, "tab\there"):
        response = router.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Request-ID": unusable}
        )
        assert response.headers["x-request-id"] != unusable
    streamed = router.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert streamed.status_code == 200 and len(streamed.headers["x-request-id"]) == 32
    ids = forwarded_ids(sim)
    assert ids[0] == made and len(set(ids)) == 4 and all(len(i) == 32 for i in ids)


def test_router_made_errors_carry_an_id_and_are_logged(router: RouterServer) -> None:
    response = router.post(
        "/v1/chat/completions", json={**CHAT, "model": "nobody"}, headers={"X-Request-ID": "e-1"}
    )
    assert response.status_code == 404 and response.headers["x-request-id"] == "e-1"
    bad = router.post("/v1/completions", content=b"{nope", headers={"X-Request-ID": "e-2"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e-2"
    [line] = wait_until(lambda: access_lines(router, "e-1"))
    assert line["status"] == 404 and line["worker"] is None and line["model"] is None
    assert wait_until(lambda: access_lines(router, "e-2"))[0]["status"] == 400


# Every answer that is not a model route's: listings, seed endpoints, 404s and 405s.
OTHER_ROUTES = [
    ("GET", "/v1/models", 200),
    ("GET", "/v1/models/m", 200),
    ("GET", "/v1/models/nobody", 404),
    ("GET", "/list_models", 200),
    ("GET", "/list_workers", 200),
    ("GET", "/health", 200),
    ("GET", "/metrics", 200),
    ("GET", "/v1/no-such-route", 404),
    ("GET", "/sleep", 404),
    ("POST", "/v1/models", 405),
    ("DELETE", "/health", 405),
]


def test_every_other_route_returns_the_request_id_and_logs_its_line(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    add_worker(simulator("m"))
    for i, (method, path, status) in enumerate(OTHER_ROUTES):
        sent = f"other.{i:02d}"
        response = httpx.request(
            method, router.url + path, headers={"X-Request-ID": sent}, timeout=10
        )
        assert response.status_code == status, (path, response.text)
        assert response.headers.get_list("x-request-id") == [sent], path
        made = httpx.request(method, router.url + path, timeout=10).headers["x-request-id"]
        assert len(made) == 32 and int(made, 16) >= 0, path

    wait_until(lambda: access_lines(router, f"other.{len(OTHER_ROUTES) - 1:02d}"))
    [line] = access_lines(router, "other.00")
    assert line["method"] == "GET" and line["path"] == "/v1/models" and line["status"] == 200
    assert line["model"] is None and line["worker"] is None and line["key"] is None
    assert line["duration_ms"] >= 0 and line["ttft_ms"] is None
    for i, (method, path, status) in enumerate(OTHER_ROUTES):
        [line] = access_lines(router, f"other.{i:02d}")
        assert (line["method"], line["path"], line["status"]) == (method, path, status)


def test_refusals_of_the_key_check_carry_an_id_and_are_logged(
    keyed_router: RouterServer,
) -> None:
    refused = keyed_router.get("/v1/models", headers={"X-Request-ID": "no-key-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key-1"
    secret = issue(keyed_router, "rid")
    headers = {**bearer(secret), "X-Request-ID": "keyed-1"}
    listed = keyed_router.get("/v1/models", headers=headers)
    assert listed.status_code == 200 and listed.headers["x-request-id"] == "keyed-1"
    [line] = wait_until(lambda: access_lines(keyed_router, "no-key-1"))
    assert line["status"] == 401 and line["key"] is None
    [line] = wait_until(lambda: access_lines(keyed_router, "keyed-1"))
    assert line["status"] == 200 and line["key"] == secret[:PREFIX_LENGTH]
    assert secret not in keyed_router.log()
