"""Outlier ejection through the real router: a failing worker leaves the rotation and a
probe brings it back."""

from __future__ import annotations

import httpx
import pytest

from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event
from tests.support.policies import use_policy
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until


@pytest.mark.django_db(transaction=True)
def test_a_failing_worker_leaves_the_rotation_and_a_probe_brings_it_back(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    good, bad = simulator("m"), simulator("m")
    add_worker(good, name="good")
    bad_worker = add_worker(bad, name="bad")
    use_policy(router, "m", "round_robin")
    httpx.post(f"{bad.url}/sim/control", json={"fail_ratio": 1})
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for _ in range(12):  # round robin: the bad one gets 5 in a row (its 500s are relayed)
        router.post("/v1/chat/completions", json=body)
    failed_before = bad.state.injected_failures
    assert failed_before == 5
    statuses = [router.post("/v1/chat/completions", json=body).status_code for _ in range(6)]
    assert statuses == [200] * 6
    assert bad.state.injected_failures == failed_before  # ejected: nothing reached it
    assert 'controlpanel_router_worker_ejected{worker="bad"} 1.0' in router.get("/metrics").text
    wait_until(lambda: Event.objects.filter(kind=EventKind.WORKER_EJECTED, worker=bad_worker))
    httpx.post(f"{bad.url}/sim/control", json={"fail_ratio": 0})
    # The test settings' cool-down is 4 s; then the router probes /health and readmits.
    wait_until(lambda: Event.objects.filter(kind=EventKind.WORKER_READMITTED, worker=bad_worker))
    received = bad.state.received
    for _ in range(6):
        assert router.post("/v1/chat/completions", json=body).status_code == 200
    assert bad.state.received > received
