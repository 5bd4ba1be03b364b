"""Admission control in process (routing.admission.admission): in-flight limits, a bounded
FIFO wait, then a refusal. Through the real router: tests/e2e/test_admission.py."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from bench.common.workers import worker_view
from routing.admission.admission import Admission

WORKERS = (worker_view(1), worker_view(2))


def first(candidates: object) -> object:
    return candidates[0]  # type: ignore[index]


def test_room_then_a_fifo_wait_then_a_timeout() -> None:
    async def scenario() -> list[object]:
        admission = Admission(per_worker=1, queue_timeout=0.3)
        inflight: defaultdict[int, int] = defaultdict(int)
        order: list[object] = []

        async def request(name: str) -> None:
            worker = await admission.acquire("m", WORKERS, None, first, inflight)  # type: ignore[arg-type]
            order.append((name, worker and worker.id))
            if worker is not None:
                inflight[worker.id] += 1
                await asyncio.sleep(0.1)
                inflight[worker.id] -= 1
                admission.release("m", ["m"])

        await asyncio.gather(*(request(f"r{i}") for i in range(5)))
        return order

    order = asyncio.run(scenario())
    assert order[:2] == [("r0", 1), ("r1", 2)]  # room on both workers at once
    assert [name for name, _ in order[2:]] == ["r2", "r3", "r4"]  # then first come, first served
    assert all(worker is not None for _, worker in order)


def test_a_full_queue_and_a_long_wait_are_refused() -> None:
    async def scenario() -> tuple[object, object]:
        admission = Admission(per_worker=0, queue_timeout=0.2, queue_max=1)
        assert await admission.acquire("m", WORKERS, 1, first, {}) is not None  # type: ignore[arg-type]
        waiting = asyncio.create_task(admission.acquire("m", WORKERS, 1, first, {}))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        refused_at_once = await admission.acquire("m", WORKERS, 1, first, {})  # type: ignore[arg-type]
        return refused_at_once, await waiting

    refused_at_once, timed_out = asyncio.run(scenario())
    assert refused_at_once is None and timed_out is None
