"""An idle router's refresher ticks every idle_poll_interval rather than every poll_interval,
and the first request wakes it at once (routing.refresher). Bounds only: a busy machine makes
ticks later, never more frequent, and the wake-up is given seconds against a minute's nap."""

from __future__ import annotations

import asyncio
import time

from routing.fleet.snapshot import Snapshot, build_snapshot
from routing.ports import RouterReport, UsageBatch
from routing.refresher import SnapshotRefresher
from routing.router import RouterApp


class CountingSource:
    """The control plane's side, counting the generation checks (one per tick)."""

    def __init__(self) -> None:
        self.checks: list[float] = []

    def generation(self) -> int:
        self.checks.append(time.monotonic())
        return 1

    def load(self) -> Snapshot:
        return build_snapshot(workers=(), served_models=(), generation=1)

    def report(self, report: RouterReport) -> bool:
        return False

    def load_reports(self) -> dict[int, tuple[int, float]]:
        return {}

    def forget(self, *, instance_id: str) -> None:
        pass

    def record_usage(self, *, usage: UsageBatch) -> None:
        pass


async def started(poll: float, idle: float) -> tuple[RouterApp, CountingSource, SnapshotRefresher]:
    router, source = RouterApp(), CountingSource()
    refresher = SnapshotRefresher(router, source, poll_interval=poll, idle_poll_interval=idle)
    await refresher.start()
    return router, source, refresher


async def _test_an_idle_router_checks_at_the_idle_interval() -> None:
    _, source, refresher = await started(poll=0.01, idle=0.5)
    try:
        await asyncio.sleep(1.2)
    finally:
        await refresher.stop()
    # Start-up's check plus at most three idle ticks; at the poll rate it would be ~120.
    assert 1 <= len(source.checks) <= 4


async def _test_the_first_request_wakes_an_idle_refresher() -> None:
    router, source, refresher = await started(poll=0.01, idle=60.0)
    try:
        await asyncio.sleep(0.3)  # past the poll interval: into the idle nap
        before = len(source.checks)
        router.request_seen.set()  # what RouterApp.__call__ does for any request
        deadline = time.monotonic() + 10
        while len(source.checks) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(source.checks) > before
    finally:
        await refresher.stop()


async def _test_requests_in_flight_keep_the_poll_rate() -> None:
    router, source, refresher = await started(poll=0.01, idle=60.0)
    router.inflight[7] = 1  # a long stream: no new request, but not idle either
    try:
        deadline = time.monotonic() + 10
        while len(source.checks) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(source.checks) >= 5
    finally:
        await refresher.stop()


def test_an_idle_router_checks_at_the_idle_interval() -> None:
    asyncio.run(_test_an_idle_router_checks_at_the_idle_interval())


def test_the_first_request_wakes_an_idle_refresher() -> None:
    asyncio.run(_test_the_first_request_wakes_an_idle_refresher())


def test_requests_in_flight_keep_the_poll_rate() -> None:
    asyncio.run(_test_requests_in_flight_keep_the_poll_rate())
