"""Admission control: in-flight limits, a bounded FIFO wait, then 429 with Retry-After."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import httpx
import pytest

from routing.admission import Admission
from tests.conftest import ADMIN_HEADERS, AddWorker, RouterServer, StartSimulator
from tests.factories import worker_view

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


@pytest.mark.django_db(transaction=True)
def test_a_model_limit_queues_and_then_answers_429(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("slow", itl_ms=60)
    add_worker(sim)
    response = httpx.patch(
        f"{router.url}/api/models/slow", json={"max_inflight": 1}, headers=ADMIN_HEADERS
    )
    assert response.status_code == 200 and response.json()["max_inflight"] == 1
    time.sleep(0.6)  # the routers poll every 0.25 s
    peak = {"running": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak["running"] = max(peak["running"], sim.state.running)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = {"model": "slow", "prompt": "x", "max_tokens": 8}  # about 0.5 s each
    with httpx.Client(timeout=30) as client:
        results: list[httpx.Response] = []

        def send() -> None:
            results.append(client.post(f"{router.url}/v1/completions", json=body))

        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200]  # the second waited its turn
        assert peak["running"] == 1
        long_body = {**body, "max_tokens": 35}  # about 2.1 s: past the 1.5 s queue timeout
        results.clear()
        slow = threading.Thread(
            target=lambda: results.append(
                client.post(f"{router.url}/v1/completions", json=long_body)
            )
        )
        slow.start()
        time.sleep(0.3)
        refused = client.post(f"{router.url}/v1/completions", json=body)
        slow.join()
    stop.set()
    watcher.join()
    assert refused.status_code == 429
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == 429
    assert results[0].status_code == 200
    assert "controlpanel_router_admission_rejected_total" in router.get("/metrics").text
    httpx.patch(f"{router.url}/api/models/slow", json={"max_inflight": 0}, headers=ADMIN_HEADERS)
