"""Retries before the first byte: another worker takes a request the first one refused,
reset, or answered 429/502/503 before any body byte; never a 4xx, never twice a 500."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from simulator.server import RunningSimulator
from tests.support.fake_workers import fake_worker
from tests.support.policies import use_policy
from tests.support.servers import AddWorker, RouterServer, StartSimulator, free_port

pytestmark = pytest.mark.django_db(transaction=True)


def chat(router: RouterServer, **extra: object) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return router.post("/v1/chat/completions", json={**body, **extra})


def retries(router: RouterServer, reason: str) -> float:
    for line in router.get("/metrics").text.splitlines():
        if line.startswith(f'controlpanel_router_retries_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def healthy(simulator: StartSimulator, add_worker: AddWorker) -> Iterator[RunningSimulator]:
    sim = simulator("m")
    add_worker(sim, name="good")
    yield sim


def test_a_refused_connection_is_tried_elsewhere(
    router: RouterServer, healthy: RunningSimulator
) -> None:
    dead = fake_worker(f"http://127.0.0.1:{free_port()}")
    router.wait_routable(dead)
    use_policy(router, "m", "round_robin")
    before = retries(router, "connect")
    answers = [chat(router) for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 6
    assert healthy.state.completed == 6
    assert retries(router, "connect") - before >= 1


def test_a_reset_before_the_answer_is_tried_elsewhere(
    router: RouterServer,
    healthy: RunningSimulator,
    resetting_server: str,
) -> None:
    router.wait_routable(fake_worker(resetting_server))
    use_policy(router, "m", "round_robin")
    assert [chat(router).status_code for _ in range(6)] == [200] * 6


@pytest.mark.parametrize("status", [429, 502, 503])
def test_not_now_answers_are_tried_elsewhere(
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    healthy: RunningSimulator,
    status: int,
) -> None:
    busy = simulator("m")
    add_worker(busy, name="busy")
    httpx.post(f"{busy.url}/sim/control", json={"fail_ratio": 1, "fail_status": status})
    use_policy(router, "m", "round_robin")
    assert [chat(router).status_code for _ in range(6)] == [200] * 6
    assert busy.state.injected_failures >= 1
    assert retries(router, f"status_{status}") >= 1


def test_a_500_is_relayed_not_retried(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    broken = [simulator("m"), simulator("m")]
    for i, sim in enumerate(broken):
        add_worker(sim, name=f"broken-{i}")
        httpx.post(f"{sim.url}/sim/control", json={"fail_ratio": 1})
    answer = chat(router)
    assert answer.status_code == 500
    assert answer.json()["error"]["message"].startswith("injected failure")
    assert sum(s.state.received for s in broken) == 1  # a generation may have run: once only


def test_a_client_error_is_not_retried(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims = [simulator("m"), simulator("m")]
    for i, sim in enumerate(sims):
        add_worker(sim, name=f"w{i}")
    answer = chat(router, max_tokens=-5)
    assert answer.status_code == 400
    assert sum(s.state.by_path["/v1/chat/completions"] for s in sims) == 1


def test_when_every_worker_refuses_the_client_gets_one_clear_502(router: RouterServer) -> None:
    for _ in range(3):
        router.wait_routable(fake_worker(f"http://127.0.0.1:{free_port()}"))
    answer = chat(router)
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == 502
