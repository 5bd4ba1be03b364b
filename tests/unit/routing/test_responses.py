"""The answers the router writes itself (routing.responses): whole JSON bodies, errors in
the route family's shape, the client gate's refusals and the proxy's rejections."""

from __future__ import annotations

import asyncio

import orjson

from routing.admission.auth import NO_KEY, Refusal
from routing.responses import refuse, reject, respond
from tests.support.exchanges import Client, exchange


def test_a_whole_answer_has_its_length_and_type() -> None:
    client = Client()
    asyncio.run(respond(client.send, 200, b"ok!", [(b"x-a", b"1")], content_type=b"text/plain"))
    start, body = client.sent
    assert start["headers"] == [(b"content-type", b"text/plain"), (b"content-length", b"3"),
                                (b"x-a", b"1")]  # fmt: skip
    assert body == {"type": "http.response.body", "body": b"ok!", "more_body": False}


def test_a_refusal_on_a_model_route_is_counted_and_carries_the_request_id() -> None:
    client = Client()
    ex = exchange(client, request_id=b"r-9")
    limited = Refusal(429, "slow down", headers=((b"retry-after", b"3"),))
    asyncio.run(refuse(client.send, limited, ex, path="/v1/chat/completions"))
    assert client.status == ex.status == 429
    headers = dict(client.sent[0]["headers"])
    assert headers[b"retry-after"] == b"3" and headers[b"x-request-id"] == b"r-9"
    error = orjson.loads(client.body)["error"]
    assert (error["message"], error["code"]) == ("slow down", 429)


def test_anthropics_routes_get_anthropics_error_shape() -> None:
    client = Client()
    asyncio.run(refuse(client.send, NO_KEY, path="/v1/messages"))
    body = orjson.loads(client.body)
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert client.status == 401


def test_a_rejection_takes_its_routes_shape_and_counts_its_status() -> None:
    openai, anthropic = Client(), Client()
    plain = exchange(openai, request_id=b"r-1")
    messages = exchange(anthropic, path="/v1/messages", request_id=b"r-2")
    asyncio.run(reject(plain, 503, "no worker", "model", extra_headers=[(b"retry-after", b"2")]))
    asyncio.run(reject(messages, 503, "no worker"))
    assert orjson.loads(openai.body)["error"]["param"] == "model"
    assert (b"retry-after", b"2") in openai.sent[0]["headers"]
    assert orjson.loads(anthropic.body)["type"] == "error"
    assert plain.status == messages.status == 503
