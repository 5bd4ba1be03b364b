"""Usage accounting for keyed requests, off the hot path.

`UsageTap` watches an answer go by on its way to the client and keeps only its last
TAIL_BYTES. When the answer ends it looks for the last `"usage": {...}` in them: the body of
a non-streamed answer ends with it, and a stream asked with `stream_options.include_usage`
sends it in its final event (vLLM's cumulative usage chunk with `continuous_usage_stats`
too, since the last one wins). Nothing is parsed while chunks flow; a chunk costs one append.

`UsageLedger` adds requests and tokens up per (key, model) in memory; the refresher takes
the totals about every two seconds and writes them to the database on its own thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
# (key id, model) -> (requests, prompt tokens, completion tokens)
UsageBatch = dict[tuple[int, str], tuple[int, int, int]]

TAIL_BYTES = 16 * 1024  # a usage event is a few hundred bytes; vLLM puts few fields after it
_MAX_OBJECT_TRIES = 8
_METERED_TYPES = (b"application/json", b"text/event-stream")


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

    __slots__ = ("_key_id", "_ledger", "_metered", "_model", "_on_tokens", "_size", "_tail")

    def __init__(
        self, ledger: UsageLedger, key_id: int, model: str, on_tokens: Callable[[int], None]
    ) -> None:
        self._ledger, self._key_id, self._model = ledger, key_id, model
        self._on_tokens = on_tokens
        self._tail: deque[bytes] = deque()
        self._size = 0
        self._metered = False

    def wrap(self, send: Send) -> Send:
        async def tapped(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                self._metered = 200 <= message["status"] < 300
                if self._metered:
                    self._ledger.count_request(self._key_id, self._model)
                    self._metered = _carries_usage(message)
            elif self._metered:
                self._feed(message.get("body", b""))
                if not message.get("more_body", False):
                    self._metered = False
                    self._finish()

        return tapped

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
        if found is not None and (found[0] or found[1]):
            self._ledger.add_tokens(self._key_id, self._model, *found)
            self._on_tokens(found[0] + found[1])


def find_usage(data: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the last `"usage": {...}` in `data`, or None.

    Chat and completions name them prompt_tokens and completion_tokens; /v1/responses and
    /v1/messages input_tokens and output_tokens; embeddings have prompt tokens only."""
    usage = _last_object_after(data, b'"usage"')
    if usage is None:
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return max(0, prompt), max(0, completion)


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


def _carries_usage(start: Message) -> bool:
    content_type = b""
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-encoding" and value.lower() != b"identity":
            return False  # compressed: nothing to read without inflating it
        if name.lower() == b"content-type":
            content_type = value.lower()
    return content_type.startswith(_METERED_TYPES)
