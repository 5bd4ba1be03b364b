"""Workers join, beat, drain and leave at run time, through the real API and router."""

from __future__ import annotations

import threading

import httpx
import pytest

from controlpanel.fleet.agent import Agent
from controlpanel.registry.models import Event, Worker
from tests.support.common import ADMIN_HEADERS, AGENT_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_admin_api_needs_the_admin_token(router: RouterServer) -> None:
    assert router.get("/api/workers").status_code == 401
    assert router.get("/api/workers", headers=AGENT_HEADERS).status_code == 401
    wrong = {"Authorization": "Bearer wrong-token-wrong-token"}
    response = router.get("/api/workers", headers=wrong)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "AuthenticationError"
    assert "CONTROLPANEL_ADMIN_TOKEN" in response.json()["error"]["message"]
    assert router.get("/api/workers", headers=ADMIN_HEADERS).status_code == 200


def test_agent_api_needs_the_worker_token(router: RouterServer) -> None:
    response = router.post(
        "/api/workers/register", json={"url": "http://127.0.0.1:1"}, headers=ADMIN_HEADERS
    )
    assert response.status_code == 401
    assert "CONTROLPANEL_WORKER_TOKEN" in response.json()["error"]["message"]


def test_add_get_drain_activate_remove(router: RouterServer, simulator: StartSimulator) -> None:
    sim = simulator("m", loras=("lora-a",))
    created = router.post(
        "/api/workers", json={"url": sim.url + "/v1/", "name": "gpu-1"}, headers=ADMIN_HEADERS
    )
    assert created.status_code == 201, created.text
    worker = created.json()
    assert worker["url"] == sim.url  # normalised
    assert worker["state"] == "active" and worker["source"] == "operator"
    assert {"id": "lora-a", "parent": "m"} in worker["models"]
    wid = worker["id"]
    assert router.get(f"/api/workers/{wid}", headers=ADMIN_HEADERS).json()["name"] == "gpu-1"

    duplicate = router.post("/api/workers", json={"url": sim.url}, headers=ADMIN_HEADERS)
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["type"] == "WorkerAlreadyExists"

    # The only worker of m: refused with the reason, unless forced.
    refused = router.post(f"/api/workers/{wid}/drain", headers=ADMIN_HEADERS)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "LastRoutableWorker"
    assert "last routable worker of m, lora-a (0 requests in flight)" in refused.text
    assert "?force=1" in refused.text
    drained = router.post(f"/api/workers/{wid}/drain?force=1", headers=ADMIN_HEADERS).json()
    assert drained["state"] in ("draining", "drained")
    router.wait_for(lambda seen: seen[wid]["state"] == "drained")
    assert (
        router.post(f"/api/workers/{wid}/activate", headers=ADMIN_HEADERS).json()["state"]
        == "active"
    )
    router.wait_for(lambda seen: seen[wid]["routable"])

    assert router.get(f"/api/workers/{wid}", headers=ADMIN_HEADERS).status_code == 200
    kept = httpx.delete(f"{router.url}/api/workers/{wid}", headers=ADMIN_HEADERS)
    assert kept.status_code == 409 and "removing it leaves m, lora-a" in kept.text
    removed = httpx.delete(f"{router.url}/api/workers/{wid}?force=1", headers=ADMIN_HEADERS)
    assert removed.status_code == 204
    assert router.get(f"/api/workers/{wid}", headers=ADMIN_HEADERS).status_code == 404
    router.wait_for(lambda seen: wid not in seen)
    kinds = list(Event.objects.order_by("id").values_list("kind", flat=True))
    assert kinds == [
        "worker_joined",
        "drain_started",
        "drain_finished",
        "worker_activated",
        "worker_left",
    ]


@pytest.mark.parametrize("url", ["not a url", "ftp://host:1", "http://host:1/?q=1"])
def test_add_refuses_bad_urls(router: RouterServer, url: str) -> None:
    response = router.post("/api/workers", json={"url": url}, headers=ADMIN_HEADERS)
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "InvalidWorkerURL"


def test_add_refuses_what_is_not_vllm(router: RouterServer) -> None:
    # The router's own /health answers, but its /v1/models lists nothing: not a worker.
    response = router.post("/api/workers", json={"url": router.url}, headers=ADMIN_HEADERS)
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "NotAVllmServer"
    unreachable = router.post(
        "/api/workers", json={"url": f"http://127.0.0.1:{free_port()}"}, headers=ADMIN_HEADERS
    )
    assert unreachable.status_code == 422
    assert unreachable.json()["error"]["type"] == "WorkerUnreachable"


def test_register_is_idempotent_and_returns_the_interval(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m")
    first = router.post("/api/workers/register", json={"url": sim.url}, headers=AGENT_HEADERS)
    again = router.post("/api/workers/register", json={"url": sim.url + "/"}, headers=AGENT_HEADERS)
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert first.json()["heartbeat_interval"] == 1  # expiry 3 s in tests, beat every third
    assert Worker.objects.count() == 1
    assert Worker.objects.get().source == "agent"


def test_register_with_models_given_by_the_agent(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m")
    body = {"url": sim.url, "models": ["m", {"id": "m-lora", "parent": "m"}]}
    response = router.post("/api/workers/register", json=body, headers=AGENT_HEADERS)
    assert response.status_code == 200
    assert Worker.objects.get().model_ids == ["m", "m-lora"]


def test_heartbeat_for_unknown_worker_is_404(router: RouterServer) -> None:
    response = router.post("/api/workers/999999/heartbeat", json={}, headers=AGENT_HEADERS)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"


def test_heartbeat_rejects_a_negative_queue(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m")
    wid = router.post("/api/workers/register", json={"url": sim.url}, headers=AGENT_HEADERS).json()[
        "id"
    ]
    response = router.post(
        f"/api/workers/{wid}/heartbeat", json={"queue_length": -1}, headers=AGENT_HEADERS
    )
    assert response.status_code == 422


def test_heartbeat_expiry_and_return(router: RouterServer, simulator: StartSimulator) -> None:
    sim = simulator("m")
    wid = router.post("/api/workers/register", json={"url": sim.url}, headers=AGENT_HEADERS).json()[
        "id"
    ]
    router.wait_for(lambda seen: seen[wid]["routable"])
    beat = router.post(
        f"/api/workers/{wid}/heartbeat", json={"queue_length": 7}, headers=AGENT_HEADERS
    )
    assert beat.status_code == 200
    router.wait_for(lambda seen: seen[wid]["queue_length"] == 7)
    # No beat for longer than the 3 s expiry: the router stops sending it requests.
    router.wait_for(lambda seen: not seen[wid]["routable"])
    body = {"model": "m", "prompt": "x"}
    assert router.post("/v1/completions", json=body).status_code == 503
    router.post(f"/api/workers/{wid}/heartbeat", json={"queue_length": 0}, headers=AGENT_HEADERS)
    router.wait_for(lambda seen: seen[wid]["routable"])
    assert router.post("/v1/completions", json=body).status_code == 200


def test_agent_registers_again_after_the_controller_forgets(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m")
    agent = Agent(
        controller=router.url,
        worker_url=sim.url,
        token=AGENT_HEADERS["Authorization"][7:],
        interval=0.2,
    )
    agent.step()
    first_id = agent.worker_id
    assert first_id is not None
    agent.step()  # a heartbeat
    Worker.objects.filter(pk=first_id).delete()  # the controller lost its registry
    agent.step()  # heartbeat gets 404, so it registers again
    assert agent.worker_id is not None and agent.worker_id != first_id
    worker = Worker.objects.get(pk=agent.worker_id)
    assert worker.url == sim.url and worker.model_ids == ["m"]


def test_drain_lets_the_stream_finish_and_sends_nothing_new(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    draining_sim, other_sim = simulator("m", itl_ms=100), simulator("m")
    draining = add_worker(draining_sim)
    add_worker(other_sim)
    other = Worker.objects.exclude(pk=draining.pk).get()
    # Park the other worker so the long stream surely lands on the one we will drain.
    router.post(f"/api/workers/{other.pk}/drain", headers=ADMIN_HEADERS)
    router.wait_for(lambda seen: not seen[other.pk]["routable"])

    events: list[str] = []

    def long_stream() -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    streamer = threading.Thread(target=long_stream)
    streamer.start()
    wait_until(lambda: draining_sim.state.running == 1)
    router.post(f"/api/workers/{other.pk}/activate", headers=ADMIN_HEADERS)
    router.post(f"/api/workers/{draining.pk}/drain", headers=ADMIN_HEADERS)
    router.wait_for(
        lambda seen: seen[draining.pk]["state"] == "draining" and seen[other.pk]["routable"]
    )
    received_before = draining_sim.state.received
    for _ in range(5):
        assert router.post("/v1/completions", json={"model": "m", "prompt": "y"}).status_code == 200
    assert draining_sim.state.received == received_before  # nothing new reached it
    assert Worker.objects.get(pk=draining.pk).state == "draining"  # a stream is in flight
    streamer.join(timeout=30)
    assert events[-1] == "data: [DONE]" and len(events) == 21  # the stream completed
    router.wait_for(lambda seen: seen[draining.pk]["state"] == "drained")
    assert draining_sim.state.cancelled == 0


def test_a_restarted_agent_rejoins_after_its_shutdown_drain(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m")
    wid = router.post("/api/workers/register", json={"url": sim.url}, headers=AGENT_HEADERS).json()[
        "id"
    ]
    assert router.post(f"/api/workers/{wid}/deregister", headers=AGENT_HEADERS).status_code == 200
    router.wait_for(lambda seen: seen[wid]["state"] == "drained")
    again = router.post("/api/workers/register", json={"url": sim.url}, headers=AGENT_HEADERS)
    assert again.json()["id"] == wid
    router.wait_for(lambda seen: seen[wid]["routable"])
    assert Event.objects.filter(kind="worker_back", worker_id=wid).exists()
