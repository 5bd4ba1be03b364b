"""Many routers, one brain (routing.peers.fleet_sync): two routers' states ticking against
a real Redis (skipped without REDIS_URL, as test_leases_redis.py), each tick run by the
test, so nothing depends on timing. Through router processes: tests/e2e/test_many_routers.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from bench.common.workers import worker_view
from routing.fleet.snapshot import build_snapshot
from routing.state import RouterConfig, RouterState
from tests.support.common import REDIS_URL, needs_redis


def router(deployment: str, url: str = REDIS_URL) -> RouterState:
    state = RouterState(RouterConfig(redis_url=url, eject_after=1))
    state.install(
        build_snapshot(
            workers=[worker_view(1), worker_view(2)],
            served_models=(),
            generation=1,
            deployment=deployment,
        )
    )
    return state


def with_two_routers(scenario: Callable[[RouterState, RouterState], Awaitable[None]]) -> None:
    deployment = f"test-{uuid.uuid4().hex}"

    async def main() -> None:
        one, two = router(deployment), router(deployment)
        try:
            await scenario(one, two)
        finally:
            for state in (one, two):
                assert state.sync is not None and state.store is not None
                await state.sync.stop()
            client = one.store.client  # type: ignore[union-attr]
            keys = [k async for k in client.scan_iter(f"controlpanel:{deployment}:*")]
            if keys:
                await client.delete(*keys)
            for state in (one, two):
                await state.store.close()  # type: ignore[union-attr]

    asyncio.run(main())


async def tick(*states: RouterState) -> None:
    for state in states:
        assert state.sync is not None
        await state.sync.tick()


@needs_redis
def test_each_router_counts_the_others_requests_in_flight() -> None:
    async def scenario(one: RouterState, two: RouterState) -> None:
        for _ in range(3):
            one.board.started(1)
        two.board.started(2)
        await tick(one, two, one)
        assert two.board.others == {1: 3} and one.board.others == {2: 1}
        assert two.loads == {1: 3, 2: 1} and one.loads == {1: 3, 2: 1}
        assert two.sync is not None and two.sync.peer_ids == [one.instance_id]
        status = two.sync.status()
        assert status["up"] and status["peers"] == 1
        assert status["deployment"] == one.snapshot.deployment

    with_two_routers(scenario)


@needs_redis
def test_an_ejection_one_router_decides_reaches_the_other() -> None:
    async def scenario(one: RouterState, two: RouterState) -> None:
        await tick(one, two)  # each has seen the other: their streams are read from now
        one.ejector.failure(2, "reset: ServerDisconnectedError")
        assert set(one.ejector.ejected_until) == {2}
        await tick(one, two)
        assert set(two.ejector.ejected_until) == {2}
        one.ejector.readmit_shared(2)  # not decided by one: nothing to share
        assert set(two.ejector.ejected_until) == {2}

    with_two_routers(scenario)


@needs_redis
def test_recent_decisions_are_merged_across_routers() -> None:
    async def scenario(one: RouterState, two: RouterState) -> None:
        one.decisions.add("m", "w1", "least_loaded", 1, 200, None)
        await tick(one, two)
        two.decisions.add("m", "w2", "least_loaded", 2, 200, None)
        merged = two.recent_decisions()["m"]
        assert [(e["worker"], e["attempts"]) for e in merged] == [("w2", 2), ("w1", 1)]

    with_two_routers(scenario)


@needs_redis
def test_a_stopped_router_leaves_the_others_counts() -> None:
    async def scenario(one: RouterState, two: RouterState) -> None:
        one.board.started(1)
        await tick(one, two)
        assert two.board.others == {1: 1}
        assert one.sync is not None
        await one.sync.stop()
        await tick(two)
        assert two.board.others == {} and two.sync is not None and two.sync.peers == 0

    with_two_routers(scenario)


def test_without_redis_each_router_falls_back_to_its_own_counts() -> None:
    async def scenario() -> None:
        state = router("test-down", "redis://127.0.0.1:1/0")
        assert state.sync is not None and state.store is not None
        state.board.others = {1: 5}  # what the peers said before Redis went away
        state.board.started(1)
        try:
            await state.sync.tick()
            assert not state.store.up and not state.sync.up
            assert state.board.others == {} and state.loads[1] == 1
            await state.sync.tick()  # down: no round trip is tried
            assert state.sync.status()["up"] is False
        finally:
            await state.sync.stop()
            await state.store.close()

    asyncio.run(scenario())
