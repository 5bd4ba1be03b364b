"""Usage accounting: tokens per key and model read from the workers' `usage`, in the
non-streamed body and in a stream's final chunk (asked for by the router, and cut out again,
when a keyed client streams without asking for it), summed in memory by each router and
written by its refresher; shown on /usage/ and /api/usage. The parsing here, without a
server (routing.admission.usage); end to end: tests/e2e/test_usage.py."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from routing.admission.auth import TokenBucket
from routing.admission.usage import (
    MAX_USAGE_EVENT,
    TAIL_BYTES,
    UsageEventCutter,
    UsageLedger,
    UsageTap,
    ask_for_usage,
    find_usage,
)


def test_usage_is_found_in_bodies_and_final_stream_events() -> None:
    body = orjson.dumps(
        {
            "choices": [{"message": {"content": 'a "usage": {"prompt_tokens": 999} trap'}}],
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
            "prompt_logprobs": None,
        }
    )
    assert find_usage(body) == (7, 5)
    stream = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"total_tokens":9,'
        b'"completion_tokens":6}}\n\ndata: [DONE]\n\n'
    )
    assert find_usage(stream) == (3, 6)
    assert find_usage(b'{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}') == (4, 0)
    assert find_usage(b'{"usage":{"input_tokens":2,"output_tokens":8}}') == (2, 8)
    for nothing in (b"data: [DONE]\n\n", b'{"usage": null}', b'{"usage":{"prompt_tokens":', b""):
        assert find_usage(nothing) is None


def test_anthropic_usage_counts_cached_prompt_tokens_too() -> None:
    # vLLM's /v1/messages: input_tokens is the prompt less what the cache read and stored.
    whole = b'{"usage":{"input_tokens":10,"output_tokens":6,"cache_creation_input_tokens":32,'
    whole += b'"cache_read_input_tokens":64}}'
    assert find_usage(whole) == (106, 6)
    # A stream's last usage is its message_delta's; message_stop carries none.
    stream = (
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":42,"output_tokens":0}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"max_tokens"},"usage":{"input_tokens":10,"output_tokens":6,'
        b'"cache_creation_input_tokens":32,"cache_read_input_tokens":0}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert find_usage(stream) == (42, 6)


def _tap_run(
    chunks: list[bytes], headers: list[tuple[bytes, bytes]], status: int = 200, *, cut: bool = False
) -> tuple[UsageLedger, list[int], list[dict[str, Any]]]:
    ledger, charged, sent = UsageLedger(), [], []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        tapped = UsageTap(ledger, 1, "m", charged.append, cut_usage_event=cut).wrap(send)
        await tapped({"type": "http.response.start", "status": status, "headers": headers})
        for i, chunk in enumerate(chunks):
            more = i < len(chunks) - 1
            await tapped({"type": "http.response.body", "body": chunk, "more_body": more})

    asyncio.run(run())
    return ledger, charged, sent


def test_the_tap_relays_every_message_and_reads_usage_split_across_chunks() -> None:
    event = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":22}}\n\n'
    filler = [b"data: " + b"x" * 1000 + b"\n\n"] * (3 * TAIL_BYTES // 1000)
    chunks = [*filler, event[:30], event[30:], b"data: [DONE]\n\n"]
    sse = [(b"content-type", b"text/event-stream")]
    ledger, charged, sent = _tap_run(chunks, sse)
    assert [m.get("body") for m in sent[1:]] == chunks
    assert ledger.take() == {(1, "m"): (1, 11, 22)} and charged == [33]
    # Compressed or failed answers are passed through without reading.
    ledger, charged, _ = _tap_run([event], [*sse, (b"content-encoding", b"gzip")])
    assert ledger.take() == {(1, "m"): (1, 0, 0)} and charged == []
    ledger, charged, _ = _tap_run([b'{"error":{},"usage":{"prompt_tokens":1}}'], sse, 400)
    assert not ledger and charged == []


def _chunk(delta: bytes, finish: bytes = b"null") -> bytes:
    head = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    choice = b'"choices":[{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":'
    return head + choice + finish + b"}]}\n\n"


# A vLLM stream asked with include_usage: the usage-only event comes just before [DONE].
USAGE_EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}\n\n'
)
STREAM_EVENTS = [
    _chunk(b'{"role":"assistant","content":""}'),
    _chunk(b'{"content":"say \\"usage\\": {\\"choices\\":[]} "}'),  # text, not a field
    _chunk(b'{"content":"x"}', b'"length"'),
    USAGE_EVENT,
    b"data: [DONE]\n\n",
]
STREAM = b"".join(STREAM_EVENTS)
WITHOUT_USAGE = STREAM.replace(USAGE_EVENT, b"")


def _cut(chunks: list[bytes]) -> list[bytes]:
    cutter = UsageEventCutter()
    out = [cutter.feed(chunk) for chunk in chunks]
    return [*out, cutter.flush()]


def test_the_cutter_takes_out_only_the_usage_event_and_holds_no_event_back() -> None:
    # One event per chunk, as vLLM writes them: each leaves at once, byte for byte.
    assert _cut(STREAM_EVENTS) == [*STREAM_EVENTS[:3], b"", STREAM_EVENTS[4], b""]
    # Split anywhere, in two or three pieces: the same bytes, minus the usage event.
    for at in range(1, len(STREAM)):
        assert b"".join(_cut([STREAM[:at], STREAM[at:]])) == WITHOUT_USAGE, at
        assert b"".join(_cut([STREAM[: at // 2], STREAM[at // 2 : at], STREAM[at:]])) == (
            WITHOUT_USAGE
        ), at
    # An unfinished event waits only until it shows it is not the usage event.
    event = STREAM_EVENTS[2]
    cutter = UsageEventCutter()
    assert cutter.feed(event[:40]) == b""
    assert cutter.feed(event[40:-10]) == event[:-10]
    assert cutter.feed(event[-10:]) == event[-10:]
    huge = b'data: {"id":"' + b"x" * MAX_USAGE_EVENT
    assert UsageEventCutter().feed(huge) == huge


def test_the_cutter_leaves_other_streams_as_they_are() -> None:
    with_nulls = STREAM.replace(USAGE_EVENT, b"").replace(b"]}\n", b'],"usage":null}\n')
    assert b"".join(_cut([with_nulls])) == with_nulls
    crlf = STREAM.replace(b"\n", b"\r\n")
    at = crlf.index(b"\r") + 20
    assert _cut([crlf[:at], crlf[at:]]) == [crlf[:at], crlf[at:], b""]
    error = b'data: {"error":{"message":"boom","usage":{}}}\n\n'
    assert b"".join(_cut([STREAM_EVENTS[0], error])) == STREAM_EVENTS[0] + error


def test_a_tap_that_cuts_reads_the_usage_and_relays_the_rest() -> None:
    sse = [(b"content-type", b"text/event-stream; charset=utf-8")]
    chunks = [STREAM[:100], STREAM[100:-30], STREAM[-30:], b""]
    ledger, charged, sent = _tap_run(chunks, sse, cut=True)
    assert b"".join(m["body"] for m in sent[1:]) == WITHOUT_USAGE
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert ledger.take() == {(1, "m"): (1, 3, 2)} and charged == [5]
    # The tokens are charged before [DONE] leaves, so the client's next request sees them.
    charged_when_done: list[list[int]] = []

    async def send(message: dict[str, Any]) -> None:
        if b"[DONE]" in message.get("body", b""):
            charged_when_done.append(list(charged))

    async def run() -> None:
        tapped = UsageTap(UsageLedger(), 1, "m", charged.append, cut_usage_event=True).wrap(send)
        await tapped({"type": "http.response.start", "status": 200, "headers": sse})
        for event in STREAM_EVENTS:
            await tapped({"type": "http.response.body", "body": event, "more_body": True})

    charged.clear()
    asyncio.run(run())
    assert charged_when_done == [[5]]
    error = b'{"error":{"message":"bad"},"choices":[],"usage":{}}'
    _, _, sent = _tap_run([error], [(b"content-type", b"application/json")], 400, cut=True)
    assert sent[1]["body"] == error


def test_a_stream_that_asked_for_its_usage_is_counted_though_the_client_left_at_done() -> None:
    """The client asked for usage itself (nothing is cut) and hung up right after [DONE]: the
    send of [DONE] fails and the stream's last message never comes; the tokens still count,
    and before [DONE] leaves."""
    sse = [(b"content-type", b"text/event-stream")]
    ledger, charged = UsageLedger(), []
    charged_when_done: list[list[int]] = []

    async def send(message: dict[str, Any]) -> None:
        if b"[DONE]" in message.get("body", b""):
            charged_when_done.append(list(charged))
            raise OSError("the client hung up")

    async def run() -> None:
        tapped = UsageTap(ledger, 1, "m", charged.append).wrap(send)
        await tapped({"type": "http.response.start", "status": 200, "headers": sse})
        for event in STREAM_EVENTS:
            await tapped({"type": "http.response.body", "body": event, "more_body": True})

    with pytest.raises(OSError):
        asyncio.run(run())
    assert charged_when_done == [[5]]
    assert ledger.take() == {(1, "m"): (1, 3, 2)}


def _asked(body: bytes, path: str = "/v1/chat/completions") -> bytes | None:
    payload = orjson.loads(body)
    asked = ask_for_usage(path, body, payload)
    if asked is not None:
        assert orjson.loads(asked) == payload  # the parsed body follows (aliases rewrite it)
    return asked


def test_the_router_asks_for_the_usage_of_streams_that_did_not() -> None:
    raw = b'{"model" : "m", "stream": true,\n "top_p": 1.0e0, "x": "}"}\n'
    assert _asked(raw) == (
        b'{"model" : "m", "stream": true,\n "top_p": 1.0e0, "x": "}"'
        b',"stream_options":{"include_usage":true}}\n'
    )
    assert _asked(b'{"model":"m","prompt":"a","stream":1}', "/v1/completions")
    merged = _asked(
        b'{"model":"m","stream":"yes","stream_options":{"continuous_usage_stats":true,"x":1}}'
    )
    assert merged and orjson.loads(merged)["stream_options"] == {"x": 1, "include_usage": True}
    for options in (b"null", b'{"include_usage":false}', b'{"include_usage":"off"}'):
        body = b'{"model":"m","stream":true,"stream_options":' + options + b"}"
        asked = _asked(body)
        assert asked and orjson.loads(asked)["stream_options"] == {"include_usage": True}
    for untouched in (
        b'{"model":"m"}',
        b'{"model":"m","stream":false}',
        b'{"model":"m","stream":"no"}',
        b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}',
        b'{"model":"m","stream":true,"stream_options":{"include_usage":"True"}}',
        b'{"model":"m","stream":true,"stream_options":"usage"}',
        b'{"model":"m","stream":true,"stream_options":[]}',
    ):
        assert _asked(untouched) is None, untouched
    for path in ("/v1/embeddings", "/v1/responses", "/v1/messages", "/tokenize"):
        assert _asked(b'{"model":"m","stream":true}', path) is None


def test_the_ledger_gives_back_what_could_not_be_written() -> None:
    ledger = UsageLedger()
    ledger.count_request(1, "m")
    ledger.add_tokens(1, "m", 3, 4)
    batch = ledger.take()
    assert not ledger
    ledger.count_request(1, "m")
    ledger.restore(batch)
    assert ledger.take() == {(1, "m"): (2, 3, 4)}


def test_token_bucket_refills_at_its_rate_and_can_go_into_debt() -> None:
    bucket = TokenBucket(60, now=0.0)  # one a second
    assert bucket.take(60, now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == pytest.approx(1.0)
    assert bucket.take(1, now=1.0) == 0.0
    bucket.charge(10, now=1.0)
    assert bucket.wait_until_positive(now=1.0) == pytest.approx(11.0)
    assert bucket.wait_until_positive(now=12.5) == 0.0
