"""Every policy through the real router, with simulated workers, switched at run time."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet import services
from controlpanel.registry.models import RoutingGeneration, Worker
from simulator.server import RunningSimulator
from tests.support.policies import fleet, use_policy
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)


def chat(router: RouterServer, model: str, text: str = "hi", **extra: object) -> httpx.Response:
    headers = extra.pop("headers", None)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    response = router.post("/v1/chat/completions", json={**body, **extra}, headers=headers)
    assert response.status_code == 200, response.text
    return response


def served(sims: list[RunningSimulator]) -> list[int]:
    return [sim.state.completed for sim in sims]


def counted(sims: list[RunningSimulator], action: Callable[[], object]) -> list[int]:
    before = served(sims)
    action()
    return [after - b for after, b in zip(served(sims), before, strict=True)]


def test_round_robin_takes_turns_once_switched_to(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims, _ = fleet(simulator, add_worker)
    use_policy(router, "m", "round_robin")
    spread = counted(sims, lambda: [chat(router, "m") for _ in range(9)])
    assert spread == [3, 3, 3]


def test_random_follows_worker_weights(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims, workers = fleet(simulator, add_worker)
    services.worker_update(worker_id=workers[0].pk, name=None, weight=0.0, actor="test")
    use_policy(router, "m", "random")
    router.wait_for(lambda seen: seen[workers[0].pk]["routable"])
    spread = counted(sims, lambda: [chat(router, "m") for _ in range(30)])
    assert spread[0] == 0 and spread[1] > 0 and spread[2] > 0


def test_power_of_two_avoids_the_loaded_worker(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims, workers = fleet(simulator, add_worker, n=2)
    Worker.objects.filter(pk=workers[0].pk).update(queue_length=50, queue_length_at=timezone.now())
    RoutingGeneration.bump()
    use_policy(router, "m", "power_of_two")
    router.wait_for(lambda seen: seen[workers[0].pk]["queue_length"] == 50)
    assert counted(sims, lambda: [chat(router, "m") for _ in range(10)]) == [0, 10]


def test_least_kv_prefers_free_cache_and_counts_fallbacks(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims, workers = fleet(simulator, add_worker, n=2)
    use_policy(router, "m", "least_kv")
    chat(router, "m")
    assert decisions(router, "m", "fallback") == 1  # no probe has run: nothing fresh
    now = timezone.now()
    for worker, kv in zip(workers, (0.9, 0.1), strict=True):
        Worker.objects.filter(pk=worker.pk).update(
            metrics={"kv_cache_usage": kv}, last_probe_at=now
        )
    RoutingGeneration.bump()
    router.wait_for(lambda seen: seen[workers[1].pk]["kv_cache_usage"] == 0.1)
    assert counted(sims, lambda: [chat(router, "m") for _ in range(8)]) == [0, 8]
    assert decisions(router, "m", "kv") >= 8


def test_session_affinity_keeps_sessions_and_moves_them_on_drain(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims, workers = fleet(simulator, add_worker)
    use_policy(router, "m", "session_affinity")
    session = {"X-Session-ID": "conversation-42"}
    spread = counted(sims, lambda: [chat(router, "m", headers=session) for _ in range(8)])
    assert sorted(spread) == [0, 0, 8]
    home = spread.index(8)
    services.worker_drain(worker_id=workers[home].pk, actor="test")
    router.wait_for(lambda seen: not seen[workers[home].pk]["routable"])
    moved = counted(sims, lambda: [chat(router, "m", headers=session) for _ in range(4)])
    assert moved[home] == 0 and sorted(moved) == [0, 0, 4]
    by_user = counted(sims, lambda: [chat(router, "m", user="alice") for _ in range(4)])
    assert sorted(by_user) == [0, 0, 4]  # the OpenAI `user` field works as a key too


def test_prefix_aware_sends_shared_prefixes_home(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims, _ = fleet(simulator, add_worker)
    use_policy(router, "m", "prefix_aware")
    system = "You are a careful assistant. " * 80
    for prefix in ("alpha", "beta"):
        spread = counted(
            sims,
            lambda p=prefix: [chat(router, "m", f"{p} {system} question {i}") for i in range(6)],
        )
        assert max(spread) >= 5, spread  # the first may land anywhere; the rest follow it
    assert decisions(router, "m", "prefix") >= 8


def decisions(router: RouterServer, model: str, reason: str) -> float:
    for family in text_string_to_metric_families(router.get("/metrics").text):
        if family.name == "controlpanel_router_policy_decisions":
            return sum(
                s.value
                for s in family.samples
                if s.labels["model"] == model and s.labels["decision"] == reason
            )
    return 0.0
