"""Priority classes through a real router: ordering under a model's in-flight limit,
shedding, the X-Priority header rules with and without client keys, and /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from controlpanel.fleet import services
from controlpanel.keys import services as keys
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS
from tests.support.keyed import add_keyed_worker, bearer, error_of, issue
from tests.support.login import logged_in
from tests.support.servers import (
    WAIT_CEILING_S,
    RouterServer,
    StartSimulator,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)


def limit(router: RouterServer, model: str, max_inflight: int) -> None:
    response = httpx.patch(
        f"{router.url}/api/models/{model}", json={"max_inflight": max_inflight},
        headers=ADMIN_HEADERS,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    router.wait_snapshot()


@pytest.fixture(scope="module")
def patient_router(
    django_db_setup: None, django_db_blocker: Any, var_dir: Path
) -> Iterator[RouterServer]:
    """A router whose queue waits long enough for a slow machine to line requests up."""
    with django_db_blocker.unblock():
        server = start_router(var_dir, CONTROLPANEL_QUEUE_TIMEOUT="20")
    yield server
    stop_process(server.proc)


@pytest.fixture
def one_slot(patient_router: RouterServer, simulator: StartSimulator) -> Iterator[RunningSimulator]:
    """A model that runs one request at a time, through the router."""
    sim = simulator("prio", itl_ms=25)
    worker = services.worker_add(url=sim.url, name="", actor="test")
    patient_router.wait_routable(worker)
    limit(patient_router, "prio", 1)
    yield sim
    limit(patient_router, "prio", 0)


def queued(router: RouterServer, priority: str) -> float:
    metrics = router.get("/metrics").text
    line = f'controlpanel_router_class_queued{{class="{priority}",model="prio"}} '
    return float(metrics.partition(line)[2].partition("\n")[0] or 0)


def post(
    router: RouterServer, tokens: int, priority: str | None = None, *, stream: bool = False
) -> httpx.Response:
    headers = {"X-Priority": priority} if priority else {}
    body = {"model": "prio", "prompt": "x", "max_tokens": tokens, "stream": stream}
    return httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=30)


def test_critical_passes_queued_standard_and_sheddable_is_shed(
    patient_router: RouterServer, one_slot: RunningSimulator
) -> None:
    router = patient_router
    finished: list[str] = []

    def send(
        name: str, tokens: int, priority: str | None = None, *, stream: bool = False
    ) -> threading.Thread:
        def run() -> None:
            assert post(router, tokens, priority, stream=stream).status_code == 200
            finished.append(name)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    # About 5 s, streamed (a silent answer would meet the 3 s upstream read timeout): the
    # others line up behind it.
    threads = [send("running", 200, stream=True)]
    wait_until(lambda: one_slot.state.running == 1)
    for number in (1, 2):
        threads.append(send(f"standard-{number}", 3))
        wait_until(lambda n=number: queued(router, "standard") == n)  # type: ignore[misc]
    threads.append(send("critical", 3, "critical"))
    wait_until(lambda: queued(router, "critical") == 1)
    shed = post(router, 3, "sheddable")
    finished_when_shed = list(finished)
    for thread in threads:
        thread.join()
    assert finished == ["running", "critical", "standard-1", "standard-2"]
    assert shed.status_code == 429 and shed.headers["retry-after"]
    assert "`sheddable` requests are shed first" in error_of(shed)["message"]
    # Turned away at once, not queued (until the 20 s queue timeout) behind the others:
    # nothing had finished yet, not even the running one.
    assert finished_when_shed == []
    metrics = router.get("/metrics").text
    assert 'controlpanel_router_class_shed_total{class="sheddable",model="prio"} 1.0' in metrics
    assert 'controlpanel_router_class_admitted_total{class="critical",model="prio"}' in metrics

    def models_page_shows_the_shed_request() -> bool:  # from the routers' reports
        page = operator.get("/models/").text
        row = page.partition('class="class-sheddable"')[2].partition("</tr>")[0]
        return "<td>0</td>" in row and 'class="warn">1</td>' in row

    operator = logged_in(router)
    wait_until(models_page_shows_the_shed_request)


def test_an_unknown_class_is_a_clear_400(
    patient_router: RouterServer, one_slot: RunningSimulator
) -> None:
    client = openai.OpenAI(base_url=f"{patient_router.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="prio", prompt="x", max_tokens=1, extra_headers={"X-Priority": "urgent"}
        )
    error = error_of(refused.value.response)
    assert error["param"] == "x-priority"
    assert "unknown priority class 'urgent'" in error["message"]
    assert "critical, standard, sheddable" in error["message"]


def test_a_key_caps_its_requests_class_and_its_class_changes_live(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    router = keyed_router
    secret = issue(router, "batch", priority="standard")
    sim = simulator("keyed-prio", itl_ms=25)
    add_keyed_worker(router, sim, secret)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=secret, max_retries=0)
    answer = client.completions.create(
        model="keyed-prio", prompt="x", max_tokens=1, extra_headers={"X-Priority": "critical"}
    )
    assert answer.choices  # served, as `standard`: asking for more is not an error
    capped = 'controlpanel_router_priority_capped_total{class="standard"} 1.0'
    assert capped in router.get("/metrics", headers=bearer(secret)).text
    key_id = keys.ApiKey.objects.get(name="batch").pk
    changed = httpx.patch(
        f"{router.url}/api/keys/{key_id}", json={"priority": "sheddable"}, headers=ADMIN_HEADERS
    )
    assert changed.status_code == 200 and changed.json()["priority"] == "sheddable"
    bad = httpx.patch(
        f"{router.url}/api/keys/{key_id}", json={"priority": "vip"}, headers=ADMIN_HEADERS
    )
    assert bad.status_code == 422 and "unknown priority class 'vip'" in bad.text
    # Now the key runs sheddable: with the model at its limit, its request is shed.
    limit(router, "keyed-prio", 1)  # and the class change has reached the router
    body = {"model": "keyed-prio", "prompt": "x", "max_tokens": 80}  # about 2 s

    def hold_the_slot() -> None:
        # With Redis the router admits against a lease it gets within a tick of the limit
        # appearing; a sheddable request that comes first is shed, so it tries again.
        deadline = time.monotonic() + WAIT_CEILING_S
        while time.monotonic() < deadline:
            answer = httpx.post(
                f"{router.url}/v1/completions", json=body, headers=bearer(secret), timeout=30
            )
            if answer.status_code != 429:
                return
            time.sleep(0.05)  # and asks again: a retry loop with the suite's ceiling

    busy = threading.Thread(target=hold_the_slot)

    def shed_now() -> bool:
        return (
            httpx.post(
                f"{router.url}/v1/completions", json={**body, "max_tokens": 1},
                headers=bearer(secret), timeout=30,
            ).status_code
            == 429
        )  # fmt: skip

    busy.start()
    try:
        wait_until(lambda: sim.state.running == 1)  # it holds the one slot: probe only now
        assert shed_now()
    finally:
        busy.join()
        limit(router, "keyed-prio", 0)
