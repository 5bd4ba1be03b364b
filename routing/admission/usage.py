"""Usage accounting for keyed requests, off the hot path.

`UsageTap` watches an answer go by on its way to the client and keeps only its last
TAIL_BYTES. When the answer ends it looks for the last `"usage": {...}` in them: the body of
a non-streamed answer ends with it, and a stream asked with `stream_options.include_usage`
sends it in its final event (vLLM's cumulative usage chunk with `continuous_usage_stats`
too, since the last one wins). Nothing is parsed while chunks flow; a chunk costs one append.

A keyed client that streams without asking for usage would otherwise go uncounted (and past
its `tpm` limit), so `ask_for_usage` asks the worker for it: on /v1/chat/completions,
/v1/completions and /inference/v1/generate, for `"stream": true` without a true
`stream_options.include_usage`, it adds
`"stream_options": {"include_usage": true}` to the forwarded body (spliced in before the
closing brace; merged into an existing `stream_options` object by writing the parsed body out
again, as routing.fleet.aliases does when a splice would be ambiguous). `UsageEventCutter` then
takes the one usage-only event vLLM adds before `data: [DONE]` (`"choices": []` and a `usage`
object) out of what the client receives, and the tap counts its tokens at once, before the
client can see the stream end and send its next request. Every other byte reaches the client
as the worker sent it; the only bytes held back are the end of a chunk that stops inside an
event which may still turn out to be that one, until the rest of the event arrives (an SSE
client cannot use half an event anyway). Streams that are compressed, framed with CRLF or
not SSE are relayed untouched (the usage event included, and counted at the end as usual).

`UsageLedger` adds requests and tokens up per (key, model) in memory; the refresher takes
the totals about every two seconds and writes them to the database on its own thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from routing.asgi_types import Message, Send

# (key id, model) -> (requests, prompt tokens, completion tokens)
UsageBatch = dict[tuple[int, str], tuple[int, int, int]]

TAIL_BYTES = 16 * 1024  # a usage event is a few hundred bytes; vLLM puts few fields after it
_MAX_OBJECT_TRIES = 8
_METERED_TYPES = (b"application/json", b"text/event-stream")
_SSE = b"text/event-stream"
_DONE = b"data: [DONE]\n\n"
# The routes whose streams take `stream_options.include_usage` (/v1/responses and
# /v1/messages streams carry their usage without being asked). vLLM's token-in generate
# takes it too; its chunks carry `"usage":null`, so the cutter parses each of them.
USAGE_OPTION_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/inference/v1/generate"}
)
MAX_USAGE_EVENT = 4096  # bytes; a longer unfinished event is relayed, it cannot be the one
# What vLLM's pydantic models take for true in a boolean field (lax mode, any case).
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_USAGE_OPTION = b',"stream_options":'


class UsageLedger:
    """Requests and tokens per (key id, model) since the last take()."""

    def __init__(self) -> None:
        self._totals: dict[tuple[int, str], list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._totals)

    def _row(self, key_id: int, model: str) -> list[int]:
        row = self._totals.get((key_id, model))
        if row is None:
            row = self._totals[key_id, model] = [0, 0, 0]
        return row

    def count_request(self, key_id: int, model: str) -> None:
        self._row(key_id, model)[0] += 1

    def add_tokens(self, key_id: int, model: str, prompt: int, completion: int) -> None:
        row = self._row(key_id, model)
        row[1] += prompt
        row[2] += completion

    def take(self) -> UsageBatch:
        taken, self._totals = self._totals, {}
        return {k: (r[0], r[1], r[2]) for k, r in taken.items()}

    def restore(self, batch: UsageBatch) -> None:
        """Put back what could not be written, so a database outage loses nothing."""
        for (key_id, model), (requests, prompt, completion) in batch.items():
            row = self._row(key_id, model)
            row[0] += requests
            row[1] += prompt
            row[2] += completion


class UsageTap:
    """Counts one answered request of a key on a model, and its tokens from `usage`.

    Only successful answers count: a name the router refused (unknown model) never becomes
    a row, so clients cannot grow the ledger with made-up model names."""

    __slots__ = (
        "_cutter",
        "_key_id",
        "_ledger",
        "_metered",
        "_model",
        "_on_tokens",
        "_size",
        "_tail",
    )

    def __init__(
        self,
        ledger: UsageLedger,
        key_id: int,
        model: str,
        on_tokens: Callable[[int], None],
        *,
        cut_usage_event: bool = False,
    ) -> None:
        """`cut_usage_event`: the router asked for this stream's usage (ask_for_usage), so
        the usage-only event is the router's, not the client's, and is taken out."""
        self._ledger, self._key_id, self._model = ledger, key_id, model
        self._on_tokens = on_tokens
        self._tail: deque[bytes] = deque()
        self._size = 0
        self._metered = False
        self._cutter = UsageEventCutter() if cut_usage_event else None

    def wrap(self, send: Send) -> Send:
        async def tapped(message: Message) -> None:
            body = message["type"] == "http.response.body"
            if not body:
                self._start(message)
            elif self._metered:
                # Counted before the client gets the bytes, and a stream at its [DONE]: a
                # client that hangs up right after it never lets the last message through.
                chunk = message.get("body", b"")
                self._feed(chunk)
                ended = not message.get("more_body", False) or chunk.endswith(_DONE)
                if ended and self._cutter is None:
                    self._metered = False
                    self._finish()
            if self._cutter is not None and body:
                await self._send_cut(send, self._cutter, message)  # counts what it cut out
                if self._metered and not message.get("more_body", False):
                    self._metered = False
                    self._finish()
            else:
                await send(message)

        return tapped

    def _start(self, message: Message) -> None:
        if message["type"] != "http.response.start":
            return
        answered = 200 <= message["status"] < 300
        if answered:
            self._ledger.count_request(self._key_id, self._model)
        kind = _readable_type(message) if answered else b""
        self._metered = kind.startswith(_METERED_TYPES)
        if not kind.startswith(_SSE):
            self._cutter = None  # an error, or nothing the cutter can read

    async def _send_cut(self, send: Send, cutter: UsageEventCutter, message: Message) -> None:
        more = message.get("more_body", False)
        body = cutter.feed(message.get("body", b""))
        if not more:
            body += cutter.flush()
        if cutter.removed and self._metered:  # counted before the client can see [DONE]
            self._metered = False
            self._tail.clear()
            self._count(find_usage(cutter.removed))
        if body or not more:
            await send({"type": "http.response.body", "body": body, "more_body": more})

    def _feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._tail.append(chunk)
        self._size += len(chunk)
        while self._size - len(self._tail[0]) >= TAIL_BYTES:
            self._size -= len(self._tail.popleft())

    def _finish(self) -> None:
        found = find_usage(b"".join(self._tail))
        self._tail.clear()
        self._count(found)

    def _count(self, found: tuple[int, int] | None) -> None:
        if found is not None and (found[0] or found[1]):
            self._ledger.add_tokens(self._key_id, self._model, *found)
            self._on_tokens(found[0] + found[1])


class UsageEventCutter:
    """Takes the usage-only event (`data: {..."choices":[],"usage":{...}}`) out of an SSE
    stream, once; everything else passes byte for byte.

    Complete events are relayed at once; only an event with `"usage"` in it is parsed. The
    unfinished event at the end of a chunk waits for its end only while it may still be the
    usage event: not once it shows a choice (`"choices":[{`) or grows past MAX_USAGE_EVENT."""

    __slots__ = ("_carry", "_done", "removed")

    def __init__(self) -> None:
        self._carry = b""
        self._done = False
        self.removed = b""  # the usage event, once it has been taken out

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            return chunk
        data = self._carry + chunk if self._carry else chunk
        if b"\r" in data:  # CRLF framing, not vLLM's (JSON escapes every CR it carries)
            self._done, self._carry = True, b""
            return data
        cut = data.rfind(b"\n\n")
        cut = 0 if cut < 0 else cut + 2
        rest = data[cut:]
        if len(rest) > MAX_USAGE_EVENT or b'"choices":[{' in rest:
            cut, rest = len(data), b""
        self._carry = rest
        ready = data[:cut]
        if b'"usage"' not in ready:
            return ready
        ready = self._without_usage_event(ready)
        if self._done:  # cut: the rest of the stream passes as it comes
            ready, self._carry = ready + self._carry, b""
        return ready

    def flush(self) -> bytes:
        rest, self._carry = self._carry, b""
        return rest

    def _without_usage_event(self, data: bytes) -> bytes:
        at = data.find(b'"usage"')
        while at >= 0:
            start = data.rfind(b"\n\n", 0, at)
            start = 0 if start < 0 else start + 2
            while data.startswith(b"\n", start):  # the end of an event relayed in part
                start += 1
            end = data.find(b"\n\n", at)
            end = len(data) if end < 0 else end + 2
            if _is_usage_event(data[start:end]):
                self._done, self.removed = True, data[start:end]
                return data[:start] + data[end:]
            at = data.find(b'"usage"', end)
        return data


def _is_usage_event(event: bytes) -> bool:
    if not event.startswith(b"data:"):
        return False  # the tail of an event relayed in part, or not an event of data
    try:
        value = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return False
    return (
        isinstance(value, dict)
        and value.get("choices") == []
        and isinstance(value.get("usage"), dict)
    )


def ask_for_usage(path: str, body: bytes, payload: dict[str, Any]) -> bytes | None:
    """The forwarded body of a keyed stream that did not ask for its usage, now asking for
    it (and `payload` updated to match); None when the request is left as it is.

    `continuous_usage_stats` is dropped from the merged options: without include_usage it
    does nothing, with it every chunk would carry usage the client never asked for."""
    if path not in USAGE_OPTION_ROUTES or not _true(payload.get("stream")):
        return None
    options = payload.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or _true(options.get("include_usage"))
    ):
        return None  # asked already, or not an object: vLLM answers that with a 400
    spliced = "stream_options" not in payload
    merged = {**(options or {}), "include_usage": True}
    merged.pop("continuous_usage_stats", None)
    payload["stream_options"] = merged  # an alias's re-serialised body keeps it too
    end = len(body.rstrip())
    if spliced and body[end - 1 : end] == b"}":
        return body[: end - 1] + _USAGE_OPTION + orjson.dumps(merged) + body[end - 1 :]
    return orjson.dumps(payload)


def _true(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() in _TRUE_STRINGS
    return isinstance(value, int | float) and value == 1


def find_usage(data: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the last `"usage": {...}` in `data`, or None.

    Chat and completions name them prompt_tokens and completion_tokens; /v1/responses and
    /v1/messages input_tokens and output_tokens; embeddings have prompt tokens only.
    /v1/messages counts cached prompt tokens apart, as Anthropic does (vLLM's input_tokens
    is its prompt_tokens less cache_read_input_tokens and cache_creation_input_tokens): the
    prompt is their sum (a streamed message's last usage is its message_delta's)."""
    usage = _last_object_after(data, b'"usage"')
    if usage is None:
        return None
    prompt = usage.get("prompt_tokens")
    if prompt is None and isinstance(prompt := usage.get("input_tokens"), int):
        for part in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            if isinstance(cached := usage.get(part), int):
                prompt += cached
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return max(0, prompt), max(0, completion)


def usage_object(data: bytes) -> dict[str, Any] | None:
    """The last `"usage": {...}` object in `data` as parsed, or None (routing.telemetry.cache_check
    reads its prompt_tokens_details)."""
    return _last_object_after(data, b'"usage"')


def _last_object_after(data: bytes, name: bytes) -> dict[str, Any] | None:
    at = data.rfind(name)
    if at < 0:
        return None
    start = data.find(b"{", at + len(name), at + len(name) + 16)
    if start < 0 or data[at + len(name) : start].strip(b" \t\r\n:") != b"":
        return None  # `"usage": null`, or the name was not a key
    # The object's end is one of the next few `}` (it may nest `prompt_tokens_details`):
    # trying them is cheaper than scanning byte by byte in Python.
    end = start
    for _ in range(_MAX_OBJECT_TRIES):
        end = data.find(b"}", end + 1)
        if end < 0:
            return None
        try:
            value = orjson.loads(data[start : end + 1])
        except orjson.JSONDecodeError:
            continue
        return value if isinstance(value, dict) else None
    return None


def _readable_type(start: Message) -> bytes:
    """The answer's content type, or b"" when it is compressed (nothing to read without
    inflating it)."""
    content_type = b""
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-encoding" and value.lower() != b"identity":
            return b""
        if name.lower() == b"content-type":
            content_type = value.lower()
    return content_type
