"""Workers started with vLLM's --api-key: the operator gives the key once, and the router,
the probes and the admin LoRA calls send it; clients never see it, and a client's own key
never reaches a worker. Real router process, simulated workers that enforce the key the way
vLLM does (401 on /v1 paths without it)."""

from __future__ import annotations

import httpx
import openai
import pytest
from django.conf import settings

from controlpanel.fleet import health
from controlpanel.fleet.agent import Agent
from controlpanel.registry.choices import EventKind, WorkerState
from controlpanel.registry.models import Event, Worker
from tests.support.common import ADMIN_HEADERS, AGENT_HEADERS
from tests.support.keyed import bearer, issue
from tests.support.login import logged_in
from tests.support.servers import RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
WORKER_KEY = "wk-7f3a9c1e5b"
CHAT = {"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def add_guarded(router: RouterServer, url: str, key: str = WORKER_KEY) -> httpx.Response:
    body = {"url": url, "api_key": key}
    return router.post("/api/workers", json=body, headers=ADMIN_HEADERS)


def test_a_worker_that_needs_a_key_is_refused_without_it_with_a_hint(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("guarded", api_key=WORKER_KEY)
    refused = add_guarded(router, sim.url, key="")
    assert refused.status_code == 422
    assert "API key" in refused.json()["error"]["message"]
    wrong = add_guarded(router, sim.url, key="not-the-key")
    assert wrong.status_code == 422 and "wrong" in wrong.json()["error"]["message"]
    bad = add_guarded(router, sim.url, key="has space")
    assert bad.status_code == 422
    assert not Worker.objects.exists()


def test_the_router_probes_and_loras_use_the_workers_key_and_never_show_it(
    router: RouterServer, client: openai.OpenAI, simulator: StartSimulator
) -> None:
    sim = simulator("guarded", api_key=WORKER_KEY)
    added = add_guarded(router, sim.url)
    assert added.status_code == 201, added.text
    assert added.json()["has_api_key"] is True and WORKER_KEY not in added.text
    worker = Worker.objects.get(pk=added.json()["id"])
    router.wait_routable(worker)

    # The client fixture sends its own (unchecked) key: the worker must get its key instead.
    reply = client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert reply.choices[0].message.content
    stream = client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    # Probes read /v1/models with the key, so the worker stays healthy and its models known.
    for _ in range(3):
        health.workers_probe()
    worker.refresh_from_db()
    assert worker.state == WorkerState.ACTIVE and not worker.last_error, worker.last_error
    listed = router.get(f"/api/workers/{worker.pk}", headers=ADMIN_HEADERS)
    assert WORKER_KEY not in listed.text and listed.json()["has_api_key"] is True
    assert WORKER_KEY not in router.get("/list_workers").text

    lora = router.post(
        f"/api/workers/{worker.pk}/loras",
        json={"lora_name": "sql", "lora_path": "/adapters/sql"},
        headers=ADMIN_HEADERS,
    )
    assert lora.status_code == 200, lora.text
    wait_until(lambda: "sql" in router.get("/list_models").json()["models"])

    cleared = httpx.patch(
        f"{router.url}/api/workers/{worker.pk}",
        json={"api_key": ""},
        headers=ADMIN_HEADERS,
        timeout=10,
    )
    assert cleared.status_code == 200 and cleared.json()["has_api_key"] is False


def test_a_clients_key_is_replaced_by_the_workers_key(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("guarded", api_key=WORKER_KEY)
    assert add_guarded(keyed_router, sim.url).status_code == 201
    secret = issue(keyed_router, "client")
    wait_until(
        lambda: (
            "guarded"
            in {
                m["id"]
                for m in keyed_router.get("/v1/models", headers=bearer(secret)).json()["data"]
            }
        )
    )
    answer = keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert answer.status_code == 200, answer.text  # the worker took its own key, not cpk_...
    assert WORKER_KEY not in answer.text and WORKER_KEY not in str(answer.headers)


def test_operators_set_and_remove_a_workers_key_in_the_dashboard(
    router: RouterServer, simulator: StartSimulator
) -> None:
    session = logged_in(router)
    token = session.cookies["csrftoken"]
    sim = simulator("guarded", api_key=WORKER_KEY)
    form = {"url": sim.url, "name": "g1", "api_key": WORKER_KEY, "csrfmiddlewaretoken": token}
    assert session.post("/workers/add", data=form).status_code == 302
    assert "Added g1, serving guarded." in session.get("/").text
    worker = Worker.objects.get(name="g1")
    page = session.get(f"/workers/{worker.pk}/").text
    assert "Set: the router" in page and WORKER_KEY not in page

    def post(**data: str) -> str:
        answer = session.post(
            f"/workers/{worker.pk}/api-key", data={**data, "csrfmiddlewaretoken": token}
        )
        assert answer.status_code == 302
        return session.get(f"/workers/{worker.pk}/").text

    assert "nothing changed" in post(api_key="  ")
    assert Worker.objects.get(pk=worker.pk).api_key == WORKER_KEY
    assert "API key not changed" in post(api_key="two words")
    assert "API key saved." in post(api_key="wk-rotated")
    assert Worker.objects.get(pk=worker.pk).api_key == "wk-rotated"
    assert "API key removed." in post(clear="1")
    assert Worker.objects.get(pk=worker.pk).api_key == ""
    # The audit trail says the key changed (and who changed it), never what it was.
    trail = Event.objects.filter(worker=worker).order_by("id")
    assert trail[0].message.endswith("and an upstream API key")
    changes = [e.message for e in trail if e.kind == EventKind.WORKER_KEY_CHANGED]
    assert changes == ["upstream API key rotated", "upstream API key removed"]
    assert not any(k in str(e.data) + e.message for e in trail for k in (WORKER_KEY, "wk-rot"))
    assert "upstream API key rotated" in session.get(f"/workers/{worker.pk}/").text


def test_an_agent_beside_a_keyed_vllm_hands_its_key_over_at_registration(
    router: RouterServer, client: openai.OpenAI, simulator: StartSimulator
) -> None:
    sim = simulator("guarded", api_key=WORKER_KEY)
    agent = Agent(
        controller=router.url,
        worker_url=sim.url,
        token=settings.CONTROLPANEL_WORKER_TOKEN,
        interval=1,
        vllm_api_key=WORKER_KEY,
    )
    agent.register()  # the controller discovers the models with the agent's key
    worker = Worker.objects.get(pk=agent.worker_id)
    assert worker.api_key == WORKER_KEY
    router.wait_routable(worker)
    assert client.chat.completions.create(**CHAT).choices  # type: ignore[call-overload]
    # Registering again without a key leaves the one set (an operator may have set it).
    again = router.post("/api/workers/register", json={"url": sim.url}, headers=AGENT_HEADERS)
    assert again.status_code == 200 and WORKER_KEY not in again.text
    assert Worker.objects.get(pk=worker.pk).api_key == WORKER_KEY
    # A new key at re-registration (vLLM restarted with another --api-key) is recorded.
    rotated = {"url": sim.url, "models": ["guarded"], "api_key": "wk-next"}
    assert router.post("/api/workers/register", json=rotated, headers=AGENT_HEADERS).is_success
    changes = Event.objects.filter(worker=worker, kind=EventKind.WORKER_KEY_CHANGED)
    assert [(e.message, e.actor) for e in changes] == [("upstream API key rotated", "agent")]
