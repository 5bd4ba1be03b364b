"""The lease script itself (routing.admission.leases.LEASE_SCRIPT) on a real Redis: how a fleet-wide
limit is split between routers with demand, by the fair-share weights waiting behind each.
CI's second tier runs these; without REDIS_URL they are skipped, as
tests/e2e/test_many_routers.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from routing.admission.leases import EPOCH_MS, LEASE_SCRIPT, LEASE_TTL_MS
from tests.support.common import REDIS_URL, needs_redis

pytestmark = needs_redis


@pytest.fixture
def lease() -> Iterator[tuple[redis.Redis, str, str]]:
    client = redis.Redis.from_url(REDIS_URL)
    key = f"controlpanel-test:lease:{uuid.uuid4().hex}"
    yield client, client.script_load(LEASE_SCRIPT), key
    client.delete(key)
    client.close()


def ask(
    lease: tuple[redis.Redis, str, str], router: str, *, demand: int, weight: float,
    inflight: int = 0, limit: int = 8, first: float = 0.0, now: int = 0,
) -> int:  # fmt: skip
    client, sha, key = lease
    now = now or int(time.time() * 1000)
    args = (router, limit, demand + 1, demand, inflight, now, LEASE_TTL_MS, weight, first)
    grant, recorded = client.evalsha(sha, 1, key, *args)  # type: ignore[arg-type,misc]
    assert int(recorded) >= max(int(grant), inflight)  # what runs stays recorded
    return int(grant)


def settle(lease: tuple[redis.Redis, str, str], weights: dict[str, float]) -> dict[str, int]:
    """A few ticks of every router asking, with its requests turning over (none running at
    the moment it asks): the grants each converges to."""
    grants: dict[str, int] = {}
    for _ in range(4):
        for router, weight in weights.items():
            grants[router] = ask(lease, router, demand=20, weight=weight)
    return grants


def test_routers_with_demand_split_a_limit_by_the_weights_waiting_behind_them(
    lease: tuple[redis.Redis, str, str],
) -> None:
    assert settle(lease, {"r1": 1.0, "r3": 3.0}) == {"r1": 2, "r3": 6}


def test_equal_weights_split_a_limit_evenly(lease: tuple[redis.Redis, str, str]) -> None:
    assert settle(lease, {"a": 4.0, "b": 4.0}) == {"a": 4, "b": 4}


def test_a_router_without_weights_counts_as_weight_one(
    lease: tuple[redis.Redis, str, str],
) -> None:
    """A router of the version before weights writes only its lease record."""
    client, _, key = lease
    now = int(time.time() * 1000)
    client.hset(key, "old", f"0:{now}:20")
    assert ask(lease, "new", demand=20, weight=3.0) == 6  # the old one is due ceil(8 / 4)


def test_a_router_over_its_share_drains_to_it(lease: tuple[redis.Redis, str, str]) -> None:
    """What runs is never called back, but a router with a backlog that got the whole limit
    first must not keep it by refilling every slot that frees."""
    client, _, key = lease
    assert ask(lease, "first", demand=20, weight=1.0) == 8  # alone: the whole limit
    assert ask(lease, "second", demand=20, weight=3.0) == 0  # nothing left yet
    # The first still runs 8: it is told its share, and its 8 stay recorded for the others.
    assert ask(lease, "first", demand=20, weight=1.0, inflight=8) == 2
    assert client.hget(key, "first").decode().startswith("8:")  # type: ignore[union-attr]
    assert ask(lease, "second", demand=20, weight=3.0) == 0  # still no room
    assert ask(lease, "first", demand=20, weight=1.0, inflight=2) == 2  # drained to its share
    assert ask(lease, "second", demand=20, weight=3.0) == 6


def average_grants(
    lease: tuple[redis.Redis, str, str], routers: dict[str, tuple[float, float]], *,
    limit: int, epochs: int = 200,
) -> dict[str, float]:  # fmt: skip
    """Every router (weight, first) asking with a backlog, ticking through `epochs` epochs,
    its requests turning over: each router's grant averaged over the epochs."""
    start, totals = int(time.time() * 1000), dict.fromkeys(routers, 0)
    for epoch in range(epochs):
        now = start + epoch * EPOCH_MS
        for _ in range(3):  # a few ticks settle each epoch's split
            grants = {
                r: ask(lease, r, demand=20, weight=w, first=f, limit=limit, now=now)
                for r, (w, f) in routers.items()
            }
        assert sum(grants.values()) == limit  # whole slots, the limit exactly, every epoch
        for router, grant in grants.items():
            totals[router] += grant
    return {router: total / epochs for router, total in totals.items()}


def test_a_fractional_share_alternates_so_its_average_is_exact(
    lease: tuple[redis.Redis, str, str],
) -> None:
    """Weights 1:2 of 4 slots are 1.33 and 2.67 slots: never more than 4 in all, and on
    average the fractions (rounding up, as before, raced for the ceil's extra slot)."""
    averages = average_grants(lease, {"a": (1.0, 0.0), "b": (2.0, 0.0)}, limit=4)
    assert averages["a"] == pytest.approx(4 / 3, abs=0.05)
    assert averages["b"] == pytest.approx(8 / 3, abs=0.05)


def test_critical_headroom_is_due_first_and_the_weights_split_the_rest(
    lease: tuple[redis.Redis, str, str],
) -> None:
    """The weight-1 router keeps 0.5 of each 4-slot worker for critical requests: it is due
    0.5 + 3.5 / 4, so its weight-1 key runs 0.875 beside the weight-3 key's 2.625 (1:3)."""
    averages = average_grants(lease, {"a": (1.0, 0.5), "b": (3.0, 0.0)}, limit=4)
    assert averages["a"] == pytest.approx(0.5 + 3.5 / 4, abs=0.05)
    assert averages["b"] == pytest.approx(3.5 * 3 / 4, abs=0.05)


def test_claims_beyond_the_limit_are_scaled_down(lease: tuple[redis.Redis, str, str]) -> None:
    averages = average_grants(lease, {"a": (1.0, 6.0), "b": (1.0, 2.0)}, limit=4)
    assert averages == pytest.approx({"a": 3.0, "b": 1.0}, abs=0.05)
