"""Admission control through the real router: a model's in-flight limit queues a request,
then answers 429 with Retry-After once the wait is past its timeout."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.common import ADMIN_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until


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
    router.wait_snapshot()  # the router routes with the limit
    peak = {"running": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak["running"] = max(peak["running"], sim.state.running)
            time.sleep(0.005)  # sampling, not waiting: the peak is what is read

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
        # About 4 s on the worker, streamed (a silent answer would meet the upstream read
        # timeout, 3 s): the queued request's 1.5 s timeout ends well before it.
        long_body = {**body, "max_tokens": 65, "stream": True}
        results.clear()
        slow = threading.Thread(
            target=lambda: results.append(
                client.post(f"{router.url}/v1/completions", json=long_body)
            )
        )
        slow.start()
        wait_until(lambda: sim.state.running == 1)  # holding the one slot
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
