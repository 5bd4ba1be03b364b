"""Public model names (aliases) that stand for one or more real model names, by weight.

A client asks for `llama-chat`; the router picks a target (`llama-3.1-8b` 90, `llama-3.3-8b`
10), changes only the `model` field of the forwarded body to the target's name, and changes
the `model` field of the answer back to the alias, streamed chunks included, so the client
never sees the name behind the alias.

Choosing the target:

* With a session key (routing.sessions: the first of the configured session headers, or the
  body's OpenAI `user` field, read once by the router) the choice is weighted rendezvous
  hashing: each target scores weight / -ln(u), where u in (0, 1) is a hash of the key and
  the target's name, and the highest score wins. The choice depends only on the key and the
  weights, so every router process agrees, and raising one target's weight only ever moves
  sessions *to* it: during a rollout a conversation changes version at most
  once, from the old to the new, however many steps the plan takes.
* Without a key, a weighted random draw.

Only targets that have a routable worker take part (the snapshot works that out when it is
built), so a target whose workers are all gone does not fail the alias's requests while
another target can serve them; if no target has a worker, the request goes to its weighted
target and gets that target's "no worker" answer.
"""

from __future__ import annotations

import math
import random
import re
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import blake2b
from itertools import accumulate
from typing import Any

import orjson

_HASH_SPAN = float(1 << 64)


@dataclass(frozen=True, slots=True)
class AliasRoute:
    """An alias as the router uses it. `targets` keeps weights > 0 only; `live` those of
    them that have a routable worker now (all of them when none has); `fallbacks` the names
    its requests move on to, in the order tried (routing.fleet.fallbacks)."""

    name: str
    targets: tuple[tuple[str, int], ...]
    live: tuple[tuple[str, int], ...] = ()
    _cumulative: tuple[int, ...] = field(default=(), repr=False)
    fallbacks: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        name: str,
        weights: Mapping[str, int],
        serving: frozenset[str],
        fallbacks: tuple[str, ...] = (),
    ) -> AliasRoute:
        targets = tuple(sorted((t, int(w)) for t, w in weights.items() if int(w) > 0))
        live = tuple(t for t in targets if t[0] in serving) or targets
        return cls(name, targets, live, tuple(accumulate(w for _, w in live)), fallbacks)

    def choose(self, session_key: str | None) -> str | None:
        if not self.live:
            return None
        if len(self.live) == 1:
            return self.live[0][0]
        if session_key is None:
            point = random.random() * self._cumulative[-1]
            return self.live[bisect_right(self._cumulative, point)][0]
        return max(self.live, key=lambda t: _rendezvous_score(session_key, t[0], t[1]))[0]


def _rendezvous_score(key: str, target: str, weight: int) -> float:
    digest = blake2b(f"{key}\x00{target}".encode(), digest_size=8).digest()
    unit = (int.from_bytes(digest, "big") + 0.5) / _HASH_SPAN  # strictly inside (0, 1)
    return weight / -math.log(unit)


_MODEL_KEY = rb'"model"\s*:\s*'


def rewrite_request_model(body: bytes, payload: dict[str, Any], alias: str, target: str) -> bytes:
    """The body with only its top-level `model` changed from `alias` to `target`.

    The bytes are spliced, not re-serialised, so everything else (number formats, key
    order, whitespace, unknown fields) reaches vLLM exactly as the client wrote it. Only
    when the alias's spelling is ambiguous in the raw bytes (escaped, or the same pair
    also nested deeper) is the parsed body written out again, with the same content."""
    spelled = orjson.dumps(alias)
    matches = list(re.finditer(_MODEL_KEY + re.escape(spelled), body))
    if len(matches) == 1:
        end = matches[0].end()
        return body[: end - len(spelled)] + orjson.dumps(target) + body[end:]
    return orjson.dumps({**payload, "model": target})


class ModelNameRewriter:
    """Renames `"model":"<target>"` to `"model":"<alias>"` in a response as it streams.

    A chunk may end in the middle of the pattern, so the few bytes at its end that could
    begin it wait for the next chunk (at most the pattern's length; an SSE event ends in a
    blank line, so in practice nothing waits)."""

    __slots__ = ("_carry", "_keep", "_pairs", "alias")

    def __init__(self, target: str, alias: str) -> None:
        self.alias = alias  # the name the client asked for (routing.telemetry.tracing reads it)
        old, new = orjson.dumps(target), orjson.dumps(alias)
        self._pairs = (
            (b'"model":' + old, b'"model":' + new),
            (b'"model": ' + old, b'"model": ' + new),
        )
        self._keep = max(len(o) for o, _ in self._pairs) - 1
        self._carry = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk if self._carry else chunk
        for old, new in self._pairs:
            if old in data:
                data = data.replace(old, new)
        cut = self._possible_start(data)
        self._carry = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        rest, self._carry = self._carry, b""
        return rest

    def _possible_start(self, data: bytes) -> int:
        """Where an unfinished pattern may begin at the end of `data` (len: nowhere)."""
        index = data.find(b'"', max(0, len(data) - self._keep))
        while index != -1:
            tail = data[index:]
            if any(old.startswith(tail) for old, _ in self._pairs):
                return index
            index = data.find(b'"', index + 1)
        return len(data)


def alias_model_entry(alias: AliasRoute, created: int, max_model_len: int | None) -> dict[str, Any]:
    """The alias's line in /v1/models: a model of its own to the SDKs, with the shortest
    context of its targets, since a request may land on any of them."""
    return {
        "id": alias.name,
        "object": "model",
        "created": created,
        "owned_by": "vllm-control-panel",
        "root": alias.name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
