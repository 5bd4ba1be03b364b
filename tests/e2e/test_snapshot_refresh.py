"""Changes made by another process reach the router's in-memory snapshot without a restart.
How soon ("within 1 s"; the refresher polls every 0.25 s) is a speed figure, not these
tests' to time."""

from __future__ import annotations

import pytest

from controlpanel.fleet import services
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def wait_until_router_sees(router: RouterServer, worker_id: int, state: str) -> None:
    wait_until(lambda: router.workers().get(worker_id, {}).get("state") == state, interval=0.02)


def test_changes_from_this_process_reach_the_router_subprocess(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("m"))
    for _ in range(3):
        services.worker_drain(worker_id=worker.pk, actor="test")
        wait_until_router_sees(router, worker.pk, "drained")
        services.worker_activate(worker_id=worker.pk, actor="test")
        wait_until_router_sees(router, worker.pk, "active")


def test_new_model_becomes_routable_without_restart(
    router: RouterServer, simulator: StartSimulator
) -> None:
    assert router.post("/v1/completions", json={"model": "late", "prompt": "x"}).status_code == 404
    sim = simulator("late")
    services.worker_add(url=sim.url, actor="test")
    wait_until(
        lambda: (
            router.post("/v1/completions", json={"model": "late", "prompt": "x"}).status_code == 200
        ),
        interval=0.02,
    )
