"""Token budgets on the router, without a server: periods and their resets, the ledger's
counting and its sync through Redis, and the client gate's refusals (routing.admission.budgets,
routing.admission.auth). The clock is injected, so a test moves to the next day without sleeping.

The sync tests that need a working Redis run when REDIS_URL names one (the second CI tier);
the unreachable-Redis one runs everywhere."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from routing.admission import budgets
from routing.admission.auth import ClientGate, key_digest
from routing.admission.budgets import DAY, MONTH, BudgetLedger, counter_name, period_of
from routing.asgi_types import Message
from routing.fleet.client_keys import ClientKey
from tests.support.common import REDIS_URL, needs_redis
from tests.support.servers import free_port


class Clock:
    """A UTC time the test moves by hand."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


def key(prefix: str = "cpk_abcdefgh", **options: Any) -> ClientKey:
    return ClientKey(id=1, name="k", prefix=prefix, digest=key_digest(prefix), **options)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- periods ---------------------------------------------------------------------------------


def test_days_and_months_are_utc_and_reset_at_the_next_one() -> None:
    late = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert period_of(DAY, late).label == "2026-12-31"
    assert period_of(DAY, late).resets_at == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_of(MONTH, late).label == "2026-12"
    assert period_of(MONTH, late).resets_at == datetime(2027, 1, 1, tzinfo=UTC)
    # 01:00 in UTC+2 is still the day before in UTC.
    east = datetime(2026, 3, 1, 1, 0, tzinfo=UTC) + timedelta(hours=-2)
    assert period_of(DAY, east.astimezone()).label == "2026-02-28"
    assert period_of(MONTH, datetime(2026, 2, 10, tzinfo=UTC)).resets_at == datetime(
        2026, 3, 1, tzinfo=UTC
    )


def test_counter_names_are_the_deployments_and_the_keys_prefix() -> None:
    period = period_of(MONTH, datetime(2026, 12, 1, tzinfo=UTC))
    name = counter_name("dep1", "cpk_abcdefgh", period)
    assert name == "controlpanel:dep1:budget:cpk_abcdefgh:month:2026-12"


# --- the ledger on its own (no Redis: this process's count) ----------------------------------


def test_a_budget_is_used_up_at_its_limit_and_the_next_day_starts_again() -> None:
    clock = Clock(datetime(2026, 12, 1, 18, 0, tzinfo=UTC))
    ledger = BudgetLedger(clock)
    daily = key(daily_tokens=100)
    ledger.charge(daily.prefix, 60)
    assert ledger.exhausted(daily) is None
    ledger.charge(daily.prefix, 40)
    spent = ledger.exhausted(daily)
    assert spent is not None and spent.used == 100 and spent.budget == 100
    assert spent.seconds_to_reset(clock()) == 6 * 3600
    assert spent.message("cpk_abcdefgh") == (
        "Daily token budget of 100 tokens for key cpk_abcdefgh is used up (100 used); "
        "it resets at 2026-12-02T00:00:00Z."
    )
    clock.at = datetime(2026, 12, 2, 0, 0, tzinfo=UTC)
    assert ledger.exhausted(daily) is None
    assert ledger.used(daily.prefix, period_of(DAY, clock())) == 0


def test_the_monthly_budget_holds_across_days_until_the_month_ends() -> None:
    clock = Clock(datetime(2026, 12, 30, 12, 0, tzinfo=UTC))
    ledger = BudgetLedger(clock)
    both = key(daily_tokens=1000, monthly_tokens=150)
    ledger.charge(both.prefix, 100)
    clock.at += timedelta(days=1)  # the 31st: a new day, the same month
    assert ledger.exhausted(both) is None
    ledger.charge(both.prefix, 60)
    spent = ledger.exhausted(both)
    assert spent is not None and spent.period.kind == MONTH and spent.used == 160
    assert "Monthly token budget of 150 tokens" in spent.message(both.prefix)
    assert "resets at 2027-01-01T00:00:00Z" in spent.message(both.prefix)
    clock.at = datetime(2027, 1, 1, tzinfo=UTC)
    assert ledger.exhausted(both) is None


def test_a_key_without_budgets_is_counted_but_never_refused() -> None:
    ledger = BudgetLedger(Clock(datetime(2026, 12, 1, tzinfo=UTC)))
    free = key()
    ledger.charge(free.prefix, 10**9)
    assert ledger.exhausted(free) is None
    # Given a budget later the same day, the day's use counts against it.
    assert ledger.exhausted(key(daily_tokens=10**9)) is not None


def test_ended_periods_are_forgotten_without_redis() -> None:
    clock = Clock(datetime(2026, 12, 1, tzinfo=UTC))
    ledger = BudgetLedger(clock)
    ledger.charge("cpk_abcdefgh", 5)
    clock.at = datetime(2027, 2, 1, tzinfo=UTC)  # a day and a month later, past both expiries
    ledger.charge("cpk_abcdefgh", 1)
    assert ledger._pending == {
        ("cpk_abcdefgh", period_of(DAY, clock())): 1,
        ("cpk_abcdefgh", period_of(MONTH, clock())): 1,
    }


# --- the client gate: refusals, live budget changes, streams counted ------------------------


def test_the_gate_refuses_a_used_up_key_with_429_retry_after_and_the_reset() -> None:
    clock = Clock(datetime(2026, 12, 1, 23, 59, 30, tzinfo=UTC))
    gate = ClientGate(budgets=BudgetLedger(clock))
    daily = key(daily_tokens=50)
    assert run(gate.admit(daily, "m")) is None
    gate._charge(daily, 53)
    refusal = run(gate.admit(daily, "m"))
    assert refusal is not None and refusal.status == 429
    assert dict(refusal.headers) == {b"retry-after": b"30"}
    assert refusal.message == (
        "Daily token budget of 50 tokens for key cpk_abcdefgh is used up (53 used); "
        "it resets at 2026-12-02T00:00:00Z."
    )
    clock.at += timedelta(seconds=30)  # midnight: the next day
    assert run(gate.admit(daily, "m")) is None


def test_a_raised_budget_lets_the_key_in_at_once_and_a_lowered_one_stops_it() -> None:
    gate = ClientGate(budgets=BudgetLedger(Clock(datetime(2026, 12, 1, 9, 0, tzinfo=UTC))))
    gate._charge(key(), 500)
    assert run(gate.admit(key(daily_tokens=400), "m")) is not None
    assert run(gate.admit(key(daily_tokens=501), "m")) is None  # the next snapshot's key
    assert run(gate.admit(key(monthly_tokens=500), "m")) is not None
    assert run(gate.admit(key(daily_tokens=None), "m")) is None


def test_a_stream_that_did_not_ask_for_usage_is_charged_to_the_budget() -> None:
    """The router asked for the usage (routing.admission.usage.ask_for_usage); the tap cuts the
    usage
    event out of what the client gets and charges its tokens to the key's budgets."""
    gate = ClientGate(budgets=BudgetLedger(Clock(datetime(2026, 12, 1, tzinfo=UTC))))
    daily = key(daily_tokens=20)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def stream() -> None:
        metered = gate.metered(send, daily, "m", cut_usage_event=True)
        headers = [(b"content-type", b"text/event-stream")]
        await metered({"type": "http.response.start", "status": 200, "headers": headers})
        for event in (
            b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n',
            b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":9}}\n\n',
            b"data: [DONE]\n\n",
        ):
            await metered({"type": "http.response.body", "body": event, "more_body": True})
        await metered({"type": "http.response.body", "body": b"", "more_body": False})

    run(stream())
    assert b'"usage":{' not in b"".join(m.get("body", b"") for m in sent)
    assert gate.budgets.used(daily.prefix, period_of(DAY, gate.budgets.now())) == 21
    refusal = run(gate.admit(daily, "m"))
    assert refusal is not None and "(21 used)" in refusal.message


# --- sync through Redis ----------------------------------------------------------------------


@pytest.fixture
def redis_namespace() -> Iterator[str]:
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    yield namespace

    async def clean() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        names = [n async for n in client.scan_iter(f"controlpanel:{namespace}:*")]
        if names:
            await client.delete(*names)
        await client.aclose()

    if REDIS_URL:
        asyncio.run(clean())


async def sync(ledger: BudgetLedger, namespace: str, *keys: ClientKey, url: str = "") -> None:
    client = aioredis.Redis.from_url(url or REDIS_URL, socket_timeout=1)
    try:
        await ledger.sync(client.pipeline(transaction=False), namespace, keys)
    finally:
        await client.aclose()


@needs_redis
def test_two_ledgers_share_their_counts_through_redis(redis_namespace: str) -> None:
    """Two routers: each pushes its charges and reads the sum, so both refuse together."""
    # Today: Redis expires a counter at its period's end plus EXPIRE_AFTER on its own clock,
    # so a fixed date's counters would be gone as soon as they were written.
    clock = Clock(datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0))
    first, second = BudgetLedger(clock), BudgetLedger(clock)
    daily = key(daily_tokens=100)
    first.charge(daily.prefix, 60)
    second.charge(daily.prefix, 30)
    run(sync(first, redis_namespace, daily))
    run(sync(second, redis_namespace, daily))
    assert second.used(daily.prefix, period_of(DAY, clock())) == 90
    assert second.exhausted(daily) is None
    second.charge(daily.prefix, 10)  # pending in `second` only
    assert second.exhausted(daily) is not None
    assert first.exhausted(daily) is None  # until its next sync
    run(sync(second, redis_namespace, daily))
    run(sync(first, redis_namespace, daily))
    spent = first.exhausted(daily)
    assert spent is not None and spent.used == 100
    assert second.used(daily.prefix, period_of(DAY, clock())) == 100  # not counted twice


@needs_redis
def test_counters_expire_after_their_period_and_the_next_day_reads_fresh(
    redis_namespace: str,
) -> None:
    clock = Clock(datetime.now(UTC))
    ledger = BudgetLedger(clock)
    daily = key(daily_tokens=10)
    ledger.charge(daily.prefix, 10)
    run(sync(ledger, redis_namespace, daily))
    today = period_of(DAY, clock())
    month = period_of(MONTH, clock())

    async def ttls() -> tuple[int, int]:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            day_name = counter_name(redis_namespace, daily.prefix, today)
            month_name = counter_name(redis_namespace, daily.prefix, month)
            return await client.ttl(day_name), await client.ttl(month_name)
        finally:
            await client.aclose()

    day_ttl, month_ttl = run(ttls())
    expected_day = (today.resets_at + budgets.EXPIRE_AFTER[DAY] - clock()).total_seconds()
    expected_month = (month.resets_at + budgets.EXPIRE_AFTER[MONTH] - clock()).total_seconds()
    assert abs(day_ttl - expected_day) <= 5, (day_ttl, expected_day)
    assert abs(month_ttl - expected_month) <= 5, (month_ttl, expected_month)
    assert ledger.exhausted(daily) is not None
    clock.at = today.resets_at  # tomorrow: new counter names, nothing used yet
    run(sync(ledger, redis_namespace, daily))
    assert ledger.exhausted(daily) is None


def test_a_failed_sync_keeps_the_counts_and_the_process_goes_on_counting() -> None:
    clock = Clock(datetime(2026, 12, 1, tzinfo=UTC))
    ledger = BudgetLedger(clock)
    daily = key(daily_tokens=100)
    ledger.charge(daily.prefix, 70)
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises((RedisConnectionError, OSError)):
        run(sync(ledger, "ns", daily, url=unreachable))
    ledger.charge(daily.prefix, 30)
    spent = ledger.exhausted(daily)
    assert spent is not None and spent.used == 100  # nothing lost, nothing counted twice
    assert ledger._pending[daily.prefix, period_of(DAY, clock())] == 100  # pushed when back
