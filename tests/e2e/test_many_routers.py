"""Many routers, one brain: router processes sharing a database and Redis route as one.

Each test starts its own router processes (replicas: separate uvicorn processes, as behind a
load balancer, so each can be addressed) on the test database and a real Redis, with
simulated vLLM workers. They run where REDIS_URL names a Redis: CI's second tier, which
fails rather than skips. The reactivated-worker case also runs with one router and no
Redis, in both tiers: the fused load fixes it for a single router too.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from controlpanel.fleet import health, served_models, services
from controlpanel.registry.models import Worker
from controlpanel.rollouts import aliases
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS, REDIS_URL, needs_redis
from tests.support.relays import TcpRelay
from tests.support.replicas import join, metric, r_health, sees, use_policy
from tests.support.servers import (
    RouterServer,
    StartSimulator,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)


def chat(router: RouterServer, text: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return httpx.post(f"{router.url}/v1/chat/completions", json={**body, **extra}, timeout=30)


def served_by(sims: list[RunningSimulator], send: Callable[[], httpx.Response]) -> int:
    """Which simulator (its index) received the one request `send` makes."""
    before = [sim.state.received for sim in sims]
    response = send()
    assert response.status_code == 200, response.text
    moved = [i for i, sim in enumerate(sims) if sim.state.received > before[i]]
    assert len(moved) == 1, moved
    return moved[0]


def credits(router: RouterServer) -> float:
    """Prefix credits the router has taken from its peers' decisions."""
    return metric(router, "controlpanel_router_shared_prefix_credits_total") or 0


def document(tag: str, words: int = 400) -> str:
    return " ".join(f"{tag}-{i}" for i in range(words))


@needs_redis
def test_a_prefix_learned_through_one_router_is_routed_alike_by_the_other(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    first, second = routers(2)
    sims = [simulator("m", max_batch=64) for _ in range(4)]
    join(sims, first, second)
    use_policy("prefix_aware", first, second)
    for i in range(8):
        doc = document(f"doc{i}")
        credited = credits(second)
        home = served_by(sims, lambda doc=doc: chat(first, doc + " first question"))
        wait_until(lambda c=credited: credits(second) > c)  # the credit crossed over
        # Without the shared index this is a cache miss for `second`: the smallest tree.
        again = served_by(sims, lambda doc=doc: chat(second, doc + " second question"))
        assert again == home, f"document {i}: first router chose {home}, second {again}"
    assert (metric(second, "controlpanel_router_shared_prefix_credits_total") or 0) >= 8
    assert (metric(first, "controlpanel_router_shared_bytes_total", direction="out") or 0) > 0
    wait_until(lambda: sees(first, second))


@needs_redis
def test_a_drain_through_one_router_is_honoured_by_the_other(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    """How soon ("within a second") is a speed figure, not this test's to time."""
    first, second = routers(2)
    sims = [simulator("m") for _ in range(2)]
    drained, _ = join(sims, first, second)
    response = first.post(f"/api/workers/{drained.pk}/drain", headers=ADMIN_HEADERS)
    assert response.status_code == 200, response.text
    wait_until(lambda: not second.workers()[drained.pk]["routable"])
    assert {served_by(sims, lambda: chat(second, "hi")) for _ in range(10)} == {1}


@needs_redis
def test_in_flight_limits_hold_for_the_whole_deployment(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    both = routers(2, CONTROLPANEL_MAX_INFLIGHT_PER_WORKER="2", CONTROLPANEL_QUEUE_TIMEOUT="30")
    sims = [simulator("m", ttft_ms=300, max_batch=64) for _ in range(2)]
    join(sims, *both)
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda i: chat(both[i % 2], f"hi {i}"), range(16)))
    assert [a.status_code for a in answers] == [200] * 16
    # Per process each router would admit 2 per worker: 4 at once on each worker.
    peaks = [sim.state.peak_running for sim in sims]
    assert max(peaks) <= 2, peaks
    assert sum(sim.state.completed for sim in sims) == 16


@needs_redis
def test_a_router_holds_a_lease_on_a_worker_it_has_never_sent_to(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    """Every router keeps a spare slot of each routable worker's limit, so its first request
    there is admitted against it rather than waiting for a tick (with the queue off it was
    refused). The lease is what is checked: a request timed into a lease round trip still
    waits for its end (routing.admission.leases' hold), which no assert here may depend on."""
    both = routers(2, CONTROLPANEL_MAX_INFLIGHT_PER_WORKER="4", CONTROLPANEL_QUEUE_TIMEOUT="5")
    sim = simulator("m", max_batch=64)
    [worker] = join([sim], *both)
    key = f"worker:{worker.id}"

    def leased(router: RouterServer) -> bool:
        return (metric(router, "controlpanel_router_lease_slots", limit=key) or 0) >= 1

    for router in both:
        wait_until(lambda r=router: leased(r))
    for router in both:
        answer = chat(router, "first")
        assert answer.status_code == 200, answer.text


@needs_redis
def test_a_models_in_flight_limit_holds_for_the_whole_deployment(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    both = routers(2, CONTROLPANEL_QUEUE_TIMEOUT="30")
    sim = simulator("m", ttft_ms=300, max_batch=64)
    join([sim], *both)
    served_models.served_model_set_limit(name="m", max_inflight=3, actor="test")

    def limited(router: RouterServer) -> bool:
        """The router applies the limit: its explanation shows the admission room."""
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        told = router.post("/api/route/explain", json=body, headers=ADMIN_HEADERS).json()
        return all("admission" in c for c in told["candidates"])

    for router in both:
        wait_until(lambda r=router: limited(r))
    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(lambda i: chat(both[i % 2], f"hi {i}"), range(12)))
    assert [a.status_code for a in answers] == [200] * 12
    assert sim.state.peak_running <= 3, sim.state.peak_running


@pytest.mark.parametrize("count", [1, 2])
def test_a_reactivated_idle_worker_takes_its_share_of_the_next_requests(
    count: int, routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    if count > 1 and not REDIS_URL:
        pytest.skip("two routers share load through Redis (the second CI tier runs it)")
    fleet = routers(count, REDIS_URL=REDIS_URL if count > 1 else "")
    sims = [simulator("m", itl_ms=100) for _ in range(2)]
    comeback, other = join(sims, *fleet)
    services.worker_drain(worker_id=other.pk, actor="test")  # the stream must land on comeback
    for router in fleet:
        router.wait_for(lambda seen: not seen[other.pk]["routable"])
    with ThreadPoolExecutor(max_workers=1) as pool:
        stream = pool.submit(chat, fleet[0], "a long answer", max_tokens=30, stream=True)
        wait_until(lambda: sims[0].state.running == 1)
        services.worker_activate(worker_id=other.pk, actor="test")
        services.worker_drain(worker_id=comeback.pk, actor="test")
        health.workers_probe()  # a real probe reads the stream on comeback: 1 running
        assert Worker.objects.get(pk=comeback.pk).queue_length == 1
        services.worker_activate(worker_id=comeback.pk, actor="test")
        for router in fleet:  # back in rotation, with the report of the probe read
            router.wait_for(
                lambda seen: (
                    seen[comeback.pk]["routable"] and seen[comeback.pk]["queue_length"] == 1
                )
            )
        assert stream.result().status_code == 200
    # The report still says "1 running" (it is 4 s old, well within its freshness), but
    # that request was the routers' own and it has ended: comeback is idle, as idle as the
    # other worker, so sequential requests split between them.
    got = [served_by(sims, lambda i=i: chat(fleet[i % count], f"hi {i}")) for i in range(24)]
    assert got.count(0) >= 6, got


@needs_redis
def test_an_ejection_by_one_router_takes_the_worker_out_of_every_router(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    first, second = routers(2)
    sims = [simulator("m"), simulator("m")]
    bad, _ = join(sims, first, second)
    sims[0].state.fail_ratio = 1.0  # answers 500 to everything
    label = {"worker": bad.name}
    for _ in range(40):
        chat(first, "hi")
        if metric(first, "controlpanel_router_worker_ejected", **label) == 1:
            break
    assert metric(first, "controlpanel_router_worker_ejected", **label) == 1
    wait_until(lambda: metric(second, "controlpanel_router_worker_ejected", **label))
    received = sims[0].state.received
    for _ in range(10):
        assert chat(second, "hi").status_code == 200
    assert sims[0].state.received == received  # the second router never tried it itself
    assert metric(second, "controlpanel_router_ejections_total", **label) is None


@needs_redis
def test_a_redis_outage_falls_back_to_local_state_and_recovers(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    target = urlsplit(REDIS_URL)
    relay = TcpRelay((target.hostname or "127.0.0.1", target.port or 6379))
    try:
        via_relay = REDIS_URL.replace(target.netloc, f"127.0.0.1:{relay.port}")
        first, second = routers(2, REDIS_URL=via_relay)
        sims = [simulator("m") for _ in range(2)]
        join(sims, first, second)
        use_policy("prefix_aware", first, second)
        wait_until(lambda: sees(first, second) and sees(second, first))

        relay.down()
        for router in (first, second):
            wait_until(lambda r=router: not r.get("/health").json()["shared_state"]["up"])
            assert r_health(router)["status"] == "degraded"
            assert metric(router, "controlpanel_router_shared_state_up") == 0
        statuses = [
            chat(router, f"q{i}").status_code for i in range(10) for router in (first, second)
        ]
        assert statuses == [200] * 20  # served from each router's own state meanwhile

        relay.up()
        for router, peer in ((first, second), (second, first)):
            wait_until(lambda r=router, p=peer: sees(r, p))
            assert r_health(router)["status"] == "ok"
            assert metric(router, "controlpanel_router_shared_state_up") == 1
        doc = document("after")
        credited = credits(second)
        home = served_by(sims, lambda: chat(first, doc + " one"))
        wait_until(lambda: credits(second) > credited)
        assert served_by(sims, lambda: chat(second, doc + " two")) == home  # shared again
        assert first.proc.poll() is None and second.proc.poll() is None
    finally:
        relay.down()


@needs_redis
def test_every_router_sends_a_session_to_the_same_alias_target(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    first, second = routers(2)
    sims = [simulator("m-old"), simulator("m-new")]
    workers = [services.worker_add(url=sim.url, actor="test") for sim in sims]
    aliases.alias_create(name="chat", targets={"m-old": 50, "m-new": 50}, actor="test")
    for router in (first, second):
        router.wait_routable(*workers)
        wait_until(lambda r=router: "chat" in r.get("/list_models").text)

    def ask(router: RouterServer, session: str) -> int:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        headers = {"X-Session-ID": session}
        send = lambda: httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=headers)  # noqa: E731
        return served_by(sims, send)

    chosen = {f"s{i}": ask(first, f"s{i}") for i in range(20)}
    assert set(chosen.values()) == {0, 1}  # both targets get sessions
    assert {key: ask(second, key) for key in chosen} == chosen


@needs_redis
def test_recent_decisions_are_merged_over_the_routers(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    first, second = routers(2)
    join([simulator("m"), simulator("m")], first, second)
    for i in range(5):
        assert chat(first, f"a{i}").status_code == 200
    for i in range(7):
        assert chat(second, f"b{i}").status_code == 200

    def merged(router: RouterServer) -> int:
        answer = router.get("/api/route/decisions?model=m", headers=ADMIN_HEADERS)
        return len(answer.json()["m"])

    # Each router publishes its ring every second and reads everyone's.
    wait_until(lambda: merged(first) == 12 and merged(second) == 12)
