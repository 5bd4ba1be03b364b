"""Cache predictions checked against the answers (routing.telemetry.cache_check): a
policy's prediction, the answer's usage read from its tail as it is relayed, and the
tallies /metrics reads."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest

from bench.common.workers import worker_view
from routing.asgi_types import Message
from routing.exchange import Exchange
from routing.policies import make_policy
from routing.policies.base import Prediction, RequestInfo
from routing.telemetry.cache_check import (
    CacheCheck,
    CacheCheckCollector,
    predicted_tokens,
)
from tests.support.metrics import parse, value


def exchange(body: dict[str, Any], sent: list[Message], **prediction: Any) -> Exchange:
    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    ex = Exchange({"type": "http"}, receive, send, 0.0, model="m", decision="prefix_hit")
    ex.policy = make_policy("round_robin", {})
    ex.request = RequestInfo("m", body, [])
    ex.worker = worker_view(1)
    fields: dict[str, Any] = {"worker_id": 1, "tokens": 64, "share": 0.0, "block_size": 16}
    ex.prediction = Prediction(ex.request, **{**fields, **prediction})
    return ex


def usage(cached: int | None, prompt: int = 100) -> dict[str, Any]:
    details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
    return {"prompt_tokens": prompt, "completion_tokens": 5, **details}


async def answer(check: CacheCheck, ex: Exchange, *chunks: bytes, status: int = 200) -> None:
    send = check.watch(ex)
    await send({"type": "http.response.start", "status": status, "headers": []})
    for i, chunk in enumerate(chunks):
        more = i < len(chunks) - 1
        await send({"type": "http.response.body", "body": chunk, "more_body": more})


def test_a_whole_answers_usage_checks_the_prediction_and_is_left_for_the_log() -> None:
    check, sent = CacheCheck(), []
    ex = exchange({}, sent, tokens=64)
    body = orjson.dumps({"id": "x", "choices": [], "usage": usage(48)})
    asyncio.run(answer(check, ex, body[:20], body[20:]))
    assert b"".join(m.get("body", b"") for m in sent) == body  # relayed untouched
    tally = check.tallies["m", "round_robin"]
    assert (tally.predicted, tally.reported, tally.within_block, tally.unchecked) == (64, 48, 1, 0)
    assert tally.errors.total == 16
    assert ex.cache == {"decision": "prefix_hit", "predicted": 64, "reported": 48, "block_size": 16}


def test_a_stream_is_checked_at_its_done_even_if_the_client_leaves_after_it() -> None:
    check = CacheCheck()
    body = {"stream": True, "stream_options": {"include_usage": True}}
    ex = exchange(body, [], tokens=None, share=0.5, block_size=16)
    last = b"data: " + orjson.dumps({"choices": [], "usage": usage(0, prompt=100)}) + b"\n\n"
    chunks = [b'data: {"choices": [{"delta": {}}]}\n\n', last, b"data: [DONE]\n\n"]

    async def scenario() -> None:
        send = check.watch(ex)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    asyncio.run(scenario())
    tally = check.tallies["m", "round_robin"]
    # half of 100 prompt tokens is 50, in whole 16-token blocks: 48; the worker held none
    assert (tally.predicted, tally.reported, tally.within_block) == (48, 0, 0)


def test_silence_is_counted_and_errors_and_other_workers_are_not_checked() -> None:
    check = CacheCheck()
    unasked = exchange({"stream": True}, [])
    assert check.watch(unasked) is unasked.send  # a stream without usage: chunks untouched
    asyncio.run(answer(check, exchange({}, []), orjson.dumps({"usage": usage(None)})))
    asyncio.run(answer(check, exchange({}, []), b'{"error": {}}', status=500))
    elsewhere = exchange({}, [], worker_id=2)  # the request was retried on another worker
    assert check.watch(elsewhere) is elsewhere.send
    tally = check.tallies["m", "round_robin"]
    assert (tally.unchecked, tally.errors.total, sum(tally.errors.counts)) == (2, 0, 0)


def test_a_share_becomes_whole_blocks_of_the_answers_prompt_tokens() -> None:
    request = RequestInfo("m", {}, [])
    share = Prediction(request, 1, None, 0.9, block_size=16)
    assert predicted_tokens(share, 100) == 80
    assert predicted_tokens(share, None) == 0
    assert predicted_tokens(Prediction(request, 1, 33, 0.0), 100) == 33


def test_the_tallies_and_kv_aware_fallbacks_are_on_metrics() -> None:
    check = CacheCheck()
    body = orjson.dumps({"usage": usage(64)})
    asyncio.run(answer(check, exchange({}, []), body))
    policy = make_policy("kv_aware", {})
    policy.fallbacks["no_tokens"] = 3  # type: ignore[attr-defined]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCheckCollector(check, lambda: {"m": policy}))
    page = parse(generate_latest(registry).decode())
    labels = {"model": "m", "policy": "round_robin"}
    assert value(page, "controlpanel_router_cache_predictions_within_block_total", **labels) == 1
    assert (
        value(page, "controlpanel_router_cache_prediction_error_tokens_bucket", le="0", **labels)
        == 1
    )
    assert value(page, "controlpanel_router_cache_reported_tokens_total", **labels) == 64
    assert (
        value(page, "controlpanel_router_kv_aware_fallbacks_total", model="m", reason="no_tokens")
        == 3
    )
