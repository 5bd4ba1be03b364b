"""The router forwards what it does not understand untouched, and relays streams live."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)

# vLLM-only fields, odd spacing, unicode and key order: none of it may change on the way.
VLLM_BODY = (
    b'{"messages":[{"role":"user","content":"caf\\u00e9 \xe2\x98\x95"}],  "model" : "m",'
    b'"guided_json":{"type":"object","properties":{"a":{"type":"integer"}}},'
    b'"extra_body":{"top_k":5},"top_k":-1,"repetition_penalty":1.05,'
    b'"max_tokens":3 }'
)


def test_body_bytes_reach_the_worker_unchanged(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    response = router.post(
        "/v1/chat/completions?trace=1",
        content=VLLM_BODY,
        headers={
            "Content-Type": "application/json",
            "X-Request-Id": "abc-123",
            "Authorization": "Bearer sk-client",
            "Connection": "keep-alive",
        },
    )
    assert response.status_code == 200, response.text
    forwarded = [r for r in sim.state.requests if r["path"] == "/v1/chat/completions"][-1]
    assert forwarded["body"] == VLLM_BODY
    headers = {k.lower(): v for k, v in forwarded["headers"].items()}
    assert headers["x-request-id"] == "abc-123"
    assert headers["authorization"] == "Bearer sk-client"
    assert headers["content-type"] == "application/json"
    assert "connection" not in headers or headers["connection"].lower() == "keep-alive"


def test_response_headers_and_body_are_relayed(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    direct = httpx.post(f"{sim.url}/tokenize", json={"model": "m", "prompt": "a b c"})
    routed = router.post("/tokenize", json={"model": "m", "prompt": "a b c"})
    assert routed.status_code == direct.status_code == 200
    assert routed.json() == direct.json()
    assert routed.headers["content-type"] == direct.headers["content-type"]
    # One Date and one Server, not the router's and the worker's both.
    assert len(routed.headers.get_list("date")) == 1
    assert len(routed.headers.get_list("server")) == 1


def test_stream_events_arrive_as_they_are_produced(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m", ttft_ms=5, itl_ms=300)
    add_worker(sim)
    body = {"model": "m", "prompt": "x", "max_tokens": 5, "stream": True}
    completed_at_arrival: list[int] = []
    events: list[bytes] = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                completed_at_arrival.append(sim.state.completed)
                events.append(line.encode())
    assert events[-1] == b"data: [DONE]"
    token_events = [json.loads(e[6:]) for e in events[:-1]]
    assert len(token_events) == 5
    # Buffered, the events would all come once the worker had finished; relayed live, the
    # first arrives while it is still generating (1.2 s of tokens after it). How evenly
    # they keep its pace is a speed figure, not this test's to time.
    assert completed_at_arrival[0] == 0, completed_at_arrival
