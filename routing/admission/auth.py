"""Client API keys on the router: who is calling, may they use this model, and how fast.

Switched on by `CONTROLPANEL_REQUIRE_API_KEY=1`. The control plane stores only a SHA-256 of
each key and ships the digests, allowed models and limits to every router inside its
snapshot, so a check is one hash, one dict lookup and one constant-time compare: no database
on the request path, and a new or revoked key reaches every router with the next snapshot.

A key is `cpk_` + 8 public characters (the *prefix*, shown on the dashboard and used to find
the record) + 43 secret characters (256 random bits).

Rate limits are token buckets per key:

- `rpm`: holds up to rpm requests and refills at rpm/60 a second; each request takes one.
- `tpm`: holds up to tpm tokens and refills at tpm/60 a second. A request is let in while the
  bucket is above zero; the prompt and completion tokens its answer reports in `usage` are
  taken afterwards, so one big answer can push the bucket below zero, which holds the key's
  next requests until it has refilled. Only answers that carry `usage` count; a stream
  that did not ask for it with `stream_options: {"include_usage": true}` is asked for it by
  the router, which takes the usage event out again before the client sees it
  (routing.admission.usage.ask_for_usage), so streaming is no way around the limit.

Token budgets per UTC day and month (`daily_tokens`, `monthly_tokens`) are checked first, in
memory: routing.admission.budgets counts every answer's tokens and shares the counts through Redis
off
the request path. A key whose budget is used up gets a 429 naming the budget and its reset,
with Retry-After the seconds until then; a request already running is never cut.

With `REDIS_URL` set the buckets live in Redis (routing.shared_store), shared by every router
process. Without it, or while Redis is unreachable, each process keeps its own, and with N
router processes a key can then get up to N times its limit.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from routing.admission.budgets import BudgetLedger, Exhausted
from routing.admission.usage import UsageLedger, UsageTap
from routing.asgi_types import Scope, Send
from routing.fleet.client_keys import ClientKey
from routing.shared_store import RedisUnavailable, SharedStore

KEY_MARK = "cpk_"
PREFIX_LENGTH = len(KEY_MARK) + 8
# Served without a key even when keys are required: load balancers and Prometheus use them.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def new_key() -> str:
    """A fresh client key; token_urlsafe(6) is exactly 8 characters."""
    return KEY_MARK + secrets.token_urlsafe(6) + secrets.token_urlsafe(32)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the gate turns away, as an OpenAI error."""

    status: int
    message: str
    param: str | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()


NO_KEY = Refusal(
    401,
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
)


def not_found(model: str) -> Refusal:
    # OpenAI's own answer for a model a key may not use: the same 404 as for a model that
    # does not exist, so a limited key cannot learn which other models are served.
    message = f"The model `{model}` does not exist or you do not have access to it."
    return Refusal(404, message, "model")


class TokenBucket:
    """`per_minute` units of capacity, refilled continuously at per_minute / 60 a second."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds to wait."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def wait_until_positive(self, now: float) -> float:
        self._refill(now)
        return 0.0 if self.level > 0 else (1.0 - self.level) / self.rate

    def charge(self, amount: float, now: float) -> None:
        """Take what was used, even past zero: the debt holds the next requests back."""
        self._refill(now)
        self.level -= amount


class ClientGate:
    """Authenticates, authorises and rate-limits keyed requests, and meters their usage.
    Lives as long as the router; its buckets survive snapshot swaps."""

    def __init__(
        self, store: SharedStore | None = None, budgets: BudgetLedger | None = None
    ) -> None:
        self.usage = UsageLedger()
        self.budgets = budgets or BudgetLedger()  # synced by routing.peers.fleet_sync with Redis
        self.store = store  # shared buckets in Redis; None: this process's own
        self._requests: dict[int, TokenBucket] = {}
        self._tokens: dict[int, TokenBucket] = {}

    def authenticate(self, scope: Scope, keys: Mapping[str, ClientKey]) -> ClientKey | Refusal:
        """The caller's key from `Authorization: Bearer` (or Anthropic's `x-api-key`), which
        is removed from the request so the client's secret never travels on to a worker."""
        token = _take_bearer(scope)
        if not token:
            return NO_KEY
        digest = key_digest(token)  # before the lookup, so a miss costs the same time
        key = keys.get(token[:PREFIX_LENGTH])
        if key is None or not hmac.compare_digest(digest, key.digest):
            return Refusal(401, f"Incorrect API key provided: {_masked(token)}.")
        return key

    async def admit(self, key: ClientKey, model: str) -> Refusal | None:
        """May this key send one more request for `model` (as the client named it) now?
        Shared buckets when Redis is configured and answering, else this process's."""
        if not key.allows(model):
            return not_found(model)
        if (spent := self.budgets.exhausted(key)) is not None:
            refusals = self.budgets.refusals
            refusals[spent.period.kind] = refusals.get(spent.period.kind, 0) + 1
            return _budget_refusal(key, spent, self.budgets.now())
        if key.tpm is None and key.rpm is None:
            return None
        if self.store is not None and self.store.up:
            try:
                which, wait = await self.store.admit(key.prefix, key.tpm, key.rpm)
            except RedisUnavailable:
                pass  # the store logged it and /health shows it; limit per process meanwhile
            else:
                return _refusal(key, which, wait) if which else None
        return self.admit_locally(key, time.monotonic())

    def admit_locally(self, key: ClientKey, now: float) -> Refusal | None:
        """The same check on this process's own buckets."""
        if key.tpm is not None:
            wait = _bucket(self._tokens, key.id, key.tpm, now).wait_until_positive(now)
            if wait:
                return _refusal(key, "tpm", wait)
        if key.rpm is not None:
            wait = _bucket(self._requests, key.id, key.rpm, now).take(1, now)
            if wait:
                return _refusal(key, "rpm", wait)
        return None

    def metered(
        self, send: Send, key: ClientKey, model: str, *, cut_usage_event: bool = False
    ) -> Send:
        """`send`, with the answer counted and its `usage` read on its way to the client;
        `cut_usage_event` when the router asked for the usage
        (routing.admission.usage.ask_for_usage)."""
        tap = UsageTap(
            self.usage,
            key.id,
            model,
            lambda used: self._charge(key, used),
            cut_usage_event=cut_usage_event,
        )
        return tap.wrap(send)

    def _charge(self, key: ClientKey, tokens: int) -> None:
        """The budgets (every key: one may get a budget later today), and for tpm both
        buckets: the shared one for the limit, the local one in case Redis goes away."""
        self.budgets.charge(key.prefix, tokens)
        if key.tpm is not None:
            now = time.monotonic()
            _bucket(self._tokens, key.id, key.tpm, now).charge(tokens, now)
            if self.store is not None and self.store.up:
                self.store.charge(key.prefix, key.tpm, tokens)


def visible_models(payload: bytes, entries: Mapping[str, Any], key: ClientKey | None) -> bytes:
    """The /v1/models answer for this caller: only what its key may use."""
    if key is None or not key.models:
        return payload
    data = [entry for name, entry in entries.items() if name in key.models]
    return orjson.dumps({"object": "list", "data": data})


def _bucket(
    buckets: dict[int, TokenBucket], key_id: int, per_minute: int, now: float
) -> TokenBucket:
    bucket = buckets.get(key_id)
    if bucket is None or bucket.capacity != per_minute:  # new key, or its limit changed
        bucket = buckets[key_id] = TokenBucket(per_minute, now)
    return bucket


def _refusal(key: ClientKey, which: str, wait: float) -> Refusal:
    if which == "tpm":
        return _rate_limited(f"tokens per minute ({key.tpm})", key, wait)
    return _rate_limited(f"requests per minute ({key.rpm})", key, wait)


def _rate_limited(limit: str, key: ClientKey, wait: float) -> Refusal:
    seconds = max(1, math.ceil(wait))
    return Refusal(
        429,
        f"Rate limit reached for key {key.prefix} on {limit}. Please try again in {seconds}s.",
        headers=((b"retry-after", str(seconds).encode()),),
    )


def _budget_refusal(key: ClientKey, spent: Exhausted, now: datetime) -> Refusal:
    seconds = spent.seconds_to_reset(now)
    return Refusal(
        429, spent.message(key.prefix), headers=((b"retry-after", str(seconds).encode()),)
    )


# Anthropic's clients (Claude Code's ANTHROPIC_API_KEY, the SDK's api_key) send the key as
# `x-api-key`; `Authorization: Bearer` wins when both come. Neither travels on.
_KEY_HEADERS = (b"authorization", b"x-api-key")


def _take_bearer(scope: Scope) -> str | None:
    headers = scope["headers"]
    kept = [(name, value) for name, value in headers if name not in _KEY_HEADERS]
    if len(kept) == len(headers):
        return None
    scope["headers"] = kept
    value = next((v for n, v in headers if n == b"authorization"), None)
    if value is None:
        key: bytes = next(v for n, v in headers if n == b"x-api-key")
        return key.decode("latin-1").strip()
    scheme, _, token = value.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _masked(token: str) -> str:
    """Enough of a wrong key for its owner to recognise it, never enough to reuse it."""
    if len(token) <= PREFIX_LENGTH + 4:
        return "*" * len(token)
    return f"{token[:PREFIX_LENGTH]}***{token[-4:]}"
