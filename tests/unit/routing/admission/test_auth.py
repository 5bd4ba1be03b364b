"""Client keys on the router (routing.admission.auth): the key read from the request and
kept from the worker, the models it may use, its token buckets and budgets, in process.
Through the real router: tests/e2e/test_api_keys.py."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from routing.admission.auth import (
    NO_KEY,
    PREFIX_LENGTH,
    ClientGate,
    TokenBucket,
    key_digest,
    new_key,
    visible_models,
)
from routing.admission.budgets import BudgetLedger
from routing.fleet.client_keys import ClientKey

SECRET = new_key()


def client_key(secret: str = SECRET, **changes: Any) -> ClientKey:
    fields: dict[str, Any] = {"id": 1, "name": "team", "prefix": secret[:PREFIX_LENGTH]}
    return ClientKey(digest=key_digest(secret), **{**fields, **changes})


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "headers": [(b"host", b"router"), *headers]}


def test_a_new_key_has_the_mark_a_public_prefix_and_256_secret_bits() -> None:
    key = new_key()
    assert key.startswith("cpk_") and len(key) == PREFIX_LENGTH + 43
    assert new_key()[:PREFIX_LENGTH] != key[:PREFIX_LENGTH]


def test_the_bearer_key_is_recognised_and_never_travels_on() -> None:
    keys = {SECRET[:PREFIX_LENGTH]: client_key()}
    request = scope((b"authorization", f"Bearer {SECRET}".encode()), (b"x-api-key", b"other"))
    assert ClientGate().authenticate(request, keys) == keys[SECRET[:PREFIX_LENGTH]]
    assert request["headers"] == [(b"host", b"router")]


def test_anthropics_x_api_key_header_is_a_key_too() -> None:
    keys = {SECRET[:PREFIX_LENGTH]: client_key()}
    request = scope((b"x-api-key", SECRET.encode()))
    assert ClientGate().authenticate(request, keys) == keys[SECRET[:PREFIX_LENGTH]]
    assert request["headers"] == [(b"host", b"router")]


def test_no_key_another_scheme_and_a_wrong_secret_are_refused() -> None:
    keys = {SECRET[:PREFIX_LENGTH]: client_key()}
    gate = ClientGate()
    assert gate.authenticate(scope(), keys) is NO_KEY
    assert gate.authenticate(scope((b"authorization", f"Basic {SECRET}".encode())), keys) is NO_KEY
    forged = SECRET[:PREFIX_LENGTH] + "x" * 39 + "ABCD"
    refusal = gate.authenticate(scope((b"authorization", f"Bearer {forged}".encode())), keys)
    assert not isinstance(refusal, ClientKey) and refusal.status == 401
    # Enough for its owner to recognise, never the secret itself.
    assert f"{SECRET[:PREFIX_LENGTH]}***ABCD" in refusal.message and "x" * 10 not in refusal.message
    short = gate.authenticate(scope((b"authorization", b"Bearer short")), keys)
    assert not isinstance(short, ClientKey) and "*****" in short.message


def test_a_key_limited_to_some_models_gets_the_same_404_as_for_a_missing_model() -> None:
    key = client_key(models=frozenset({"m"}))
    gate = ClientGate()
    assert asyncio.run(gate.admit(key, "m")) is None
    refusal = asyncio.run(gate.admit(key, "secret-model"))
    assert refusal is not None and (refusal.status, refusal.param) == (404, "model")
    assert "`secret-model` does not exist or you do not have access to it" in refusal.message


def test_requests_per_minute_refill_continuously() -> None:
    gate = ClientGate()
    key = client_key(rpm=2)
    assert gate.admit_locally(key, now=100.0) is None
    assert gate.admit_locally(key, now=100.0) is None
    refusal = gate.admit_locally(key, now=100.0)
    assert refusal is not None and refusal.status == 429
    assert "requests per minute (2)" in refusal.message
    assert refusal.headers == ((b"retry-after", b"30"),)  # one request refills in 30 s
    assert gate.admit_locally(key, now=130.0) is None


def test_a_changed_limit_starts_a_fresh_bucket() -> None:
    gate = ClientGate()
    assert gate.admit_locally(client_key(rpm=1), now=0.0) is None
    assert gate.admit_locally(client_key(rpm=1), now=0.0) is not None
    assert gate.admit_locally(client_key(rpm=5), now=0.0) is None


def test_a_big_answer_charged_past_zero_holds_the_next_requests_until_it_refills() -> None:
    bucket = TokenBucket(60, now=0.0)  # a token a second
    assert bucket.wait_until_positive(0.0) == 0.0
    bucket.charge(90, now=0.0)  # 30 tokens in debt
    assert bucket.wait_until_positive(0.0) == 31.0
    assert bucket.wait_until_positive(31.0) == 0.0
    assert bucket.take(100, now=31.0) > 0  # never more than the bucket holds
    assert bucket.level == 1.0  # a refused take takes nothing


def test_a_used_up_budget_is_a_429_until_the_period_resets() -> None:
    noon = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    gate = ClientGate(budgets=BudgetLedger(now=lambda: noon))
    key = client_key(daily_tokens=100)
    gate.budgets.charge(key.prefix, 60)
    assert asyncio.run(gate.admit(key, "m")) is None
    gate.budgets.charge(key.prefix, 40)
    refusal = asyncio.run(gate.admit(key, "m"))
    assert refusal is not None and refusal.status == 429
    assert "Daily token budget of 100 tokens" in refusal.message
    assert refusal.headers == ((b"retry-after", str(12 * 3600).encode()),)
    assert gate.budgets.refusals == {"day": 1}


def test_models_listing_shows_only_what_the_key_may_use() -> None:
    entries = {"a": {"id": "a"}, "b": {"id": "b"}}
    payload = orjson.dumps({"object": "list", "data": list(entries.values())})
    assert visible_models(payload, entries, None) is payload
    assert visible_models(payload, entries, client_key()) is payload
    limited = visible_models(payload, entries, client_key(models=frozenset({"b"})))
    assert orjson.loads(limited) == {"object": "list", "data": [{"id": "b"}]}


def test_a_metered_answers_usage_is_charged_to_the_key_before_the_client_sees_it() -> None:
    noon = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    gate = ClientGate(budgets=BudgetLedger(now=lambda: noon))
    key = client_key(tpm=60, daily_tokens=100_000)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def answer() -> None:
        metered = gate.metered(send, key, "m")
        body = orjson.dumps(
            {"choices": [], "usage": {"prompt_tokens": 6000, "completion_tokens": 4000}}
        )
        await metered({"type": "http.response.start", "status": 200,
                       "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await metered({"type": "http.response.body", "body": body, "more_body": False})

    asyncio.run(answer())
    assert sent[-1]["body"].endswith(b"}")  # relayed untouched
    assert gate.budgets.exhausted(key) is None
    gate.budgets.charge(key.prefix, 90_000)
    assert gate.budgets.exhausted(key) is not None  # 10 000 + 90 000 of 100 000
    # 9 940 tokens in debt at a token a second: refused for hours, however slow the machine.
    refusal = gate.admit_locally(key, time.monotonic())
    assert refusal is not None and "tokens per minute (60)" in refusal.message
