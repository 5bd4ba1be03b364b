"""Rate limits shared by every router process (routing.shared_store): the Lua buckets on a
real Redis (skipped without REDIS_URL, as admission/test_leases_redis.py), and what the
store and the client gate do while Redis is away."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from routing.admission.auth import ClientGate
from routing.fleet.client_keys import ClientKey
from routing.shared_store import KEY_PREFIX, RedisUnavailable, SharedStore
from tests.support.common import REDIS_URL, needs_redis

NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def with_store(url: str, scenario: Callable[[SharedStore, str], Awaitable[Any]]) -> Any:
    prefix = f"cpk_{uuid.uuid4().hex[:8]}"

    async def main() -> Any:
        store = SharedStore(url)
        try:
            return await scenario(store, prefix)
        finally:
            if store.up:
                keys = [k async for k in store.client.scan_iter(f"{KEY_PREFIX}{prefix}:*")]
                if keys:
                    await store.client.delete(*keys)
            await store.close()

    return asyncio.run(main())


@needs_redis
def test_two_processes_stores_share_one_requests_bucket() -> None:
    async def scenario(store: SharedStore, prefix: str) -> list[str]:
        other = SharedStore(REDIS_URL)  # another router process
        try:
            answers = [await s.admit(prefix, None, 3) for s in (store, other, store, other)]
        finally:
            await other.close()
        assert answers[-1][1] > 0  # the seconds until one request refills
        return [which for which, _ in answers]

    assert with_store(REDIS_URL, scenario) == ["", "", "", "rpm"]


@needs_redis
def test_a_charge_past_zero_holds_the_keys_tokens_until_they_refill() -> None:
    async def scenario(store: SharedStore, prefix: str) -> tuple[str, float]:
        assert await store.admit(prefix, 600, None) == ("", 0.0)
        await store._charge(prefix, 600, 700)  # what charge() runs in the background
        return await store.admit(prefix, 600, None)

    which, wait = with_store(REDIS_URL, scenario)
    assert which == "tpm" and 9 < wait <= 11  # 101 tokens in debt at 10 a second


def test_an_unreachable_redis_marks_the_store_down_and_says_why() -> None:
    async def scenario(store: SharedStore, prefix: str) -> str | None:
        with pytest.raises(RedisUnavailable):
            await store.admit(prefix, 60, 60)
        assert not store.up
        with pytest.raises(RedisUnavailable):  # while down, no call is tried
            await store.admit(prefix, 60, 60)
        await store.ping_if_due()
        return store.error

    error = with_store(NOWHERE, scenario)
    assert error is not None and "Connection" in error


def test_the_gate_limits_per_process_while_redis_is_away() -> None:
    key = ClientKey(id=1, name="k", prefix="cpk_aaaaaaaa", digest=b"d", rpm=1)

    async def scenario(store: SharedStore, prefix: str) -> list[int | None]:
        gate = ClientGate(store)
        answers = [await gate.admit(key, "m"), await gate.admit(key, "m")]
        assert not store.up
        return [None if a is None else a.status for a in answers]

    assert with_store(NOWHERE, scenario) == [None, 429]


@needs_redis
def test_a_store_marked_down_comes_back_with_the_ping() -> None:
    async def scenario(store: SharedStore, prefix: str) -> bool:
        store.mark_down(ConnectionError("a peer saw it fail"))
        assert not store.up
        await store.ping_if_due()
        return store.up

    assert with_store(REDIS_URL, scenario) is True
