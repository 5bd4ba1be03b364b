"""The lease script itself (routing.leases.LEASE_SCRIPT) on a real Redis: how a fleet-wide
limit is split between routers with demand, by the fair-share weights waiting behind each.
CI's second tier runs these; without REDIS_URL they are skipped, as tests/test_many_routers.py."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from routing.leases import LEASE_SCRIPT, LEASE_TTL_MS

REDIS_URL = os.environ.get("REDIS_URL", "")
pytestmark = pytest.mark.skipif(
    not REDIS_URL, reason="needs REDIS_URL (the second CI tier runs it against a real Redis)"
)


@pytest.fixture
def lease() -> Iterator[tuple[redis.Redis, str, str]]:
    client = redis.Redis.from_url(REDIS_URL)
    key = f"controlpanel-test:lease:{uuid.uuid4().hex}"
    yield client, client.script_load(LEASE_SCRIPT), key
    client.delete(key)
    client.close()


def ask(
    lease: tuple[redis.Redis, str, str], router: str, *, demand: int, weight: float,
    inflight: int = 0, limit: int = 8,
) -> int:  # fmt: skip
    client, sha, key = lease
    now = int(time.time() * 1000)
    args = (router, limit, demand + 1, demand, inflight, now, LEASE_TTL_MS, weight)
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
