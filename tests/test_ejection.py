"""Outlier ejection: the rule on its own, then through the real router."""

from __future__ import annotations

import httpx
import pytest

from controlpanel.registry.models import Event, EventKind
from routing.ejection import Ejector
from tests.conftest import AddWorker, RouterServer, StartSimulator, wait_until
from tests.factories import worker_view
from tests.test_policies_e2e import use_policy


def test_consecutive_failures_eject_and_a_success_forgives() -> None:
    ejector = Ejector(threshold=3, base_cooldown=5)
    for _ in range(2):
        ejector.failure(1, "reset", now=0)
    ejector.success(1)
    ejector.failure(1, "reset", now=0)
    assert not ejector.ejected_until
    ejector.failure(1, "reset", now=0)
    ejector.failure(1, "reset", now=0)
    assert ejector.ejected_until == {1: 5}
    assert [e.kind for e in ejector.take_events()] == ["ejected"]


def test_cool_down_doubles_on_repeats_and_resets_after_a_quiet_spell() -> None:
    ejector = Ejector(threshold=1, base_cooldown=5, max_cooldown=15, forgive_after=100)
    cooldowns = []
    now = 0.0
    for _ in range(4):
        ejector.failure(7, "500", now=now)
        cooldowns.append(ejector.ejected_until[7] - now)
        now = ejector.ejected_until[7]
        ejector.probed(7, healthy=True, detail="ok", now=now)
    assert cooldowns == [5, 10, 15, 15]
    ejector.failure(7, "500", now=now + 1000)
    assert ejector.ejected_until[7] - (now + 1000) == 5


def test_a_failed_probe_ejects_again_for_longer() -> None:
    ejector = Ejector(threshold=1, base_cooldown=2)
    ejector.failure(3, "refused", now=0)
    assert ejector.due_for_probe(now=1) == []
    assert ejector.due_for_probe(now=2) == [3]
    ejector.probed(3, healthy=False, detail="refused", now=2)
    assert ejector.ejected_until[3] == 6


def test_routable_leaves_out_the_ejected_unless_all_are() -> None:
    workers = (worker_view(1), worker_view(2))
    ejector = Ejector(threshold=1)
    assert ejector.routable(workers) is workers
    ejector.failure(1, "x")
    assert [w.id for w in ejector.routable(workers)] == [2]
    ejector.failure(2, "x")
    assert ejector.routable(workers) is workers


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
