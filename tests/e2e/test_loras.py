"""LoRA adapters: loaded and unloaded by admins through the control API, never through the
public router; the router routes an adapter as soon as the worker lists it."""

from __future__ import annotations

import httpx
import openai
import pytest

from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_admin_loads_and_unloads_an_adapter(
    router: RouterServer, client: openai.OpenAI, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("base"))
    api = f"{router.url}/api/workers/{worker.pk}/loras"
    body = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
    loaded = httpx.post(api, json=body, headers=ADMIN_HEADERS, timeout=10)
    assert loaded.status_code == 200, loaded.text
    assert {"id": "sql-lora", "parent": "base"} in loaded.json()["models"]
    wait_until(lambda: "sql-lora" in router.get("/list_models").json()["models"])
    reply = client.chat.completions.create(
        model="sql-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert reply.model == "sql-lora"
    again = httpx.post(api, json=body, headers=ADMIN_HEADERS, timeout=10)
    assert again.status_code == 409
    assert "already been loaded" in again.json()["error"]["message"]
    gone = httpx.delete(f"{api}/sql-lora", headers=ADMIN_HEADERS, timeout=10)
    assert gone.status_code == 200 and "sql-lora" not in {m["id"] for m in gone.json()["models"]}
    wait_until(lambda: "sql-lora" not in router.get("/list_models").json()["models"])
    assert Event.objects.filter(kind=EventKind.MODELS_CHANGED, worker=worker).count() == 2


def test_the_public_router_never_loads_adapters(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("base")
    add_worker(sim)
    body = {"model": "base", "lora_name": "evil", "lora_path": "/tmp/evil"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert router.post(path, json=body).status_code == 404
    assert httpx.post(f"{router.url}/api/workers/1/loras", json=body).status_code == 401
    assert "evil" not in sim.state.models


def test_an_unreachable_worker_is_reported(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("base"))
    worker.url = "http://127.0.0.1:9"  # the discard port: nothing listens
    worker.save(update_fields=["url"])
    answer = httpx.post(
        f"{router.url}/api/workers/{worker.pk}/loras",
        json={"lora_name": "x", "lora_path": "/x"},
        headers=ADMIN_HEADERS,
        timeout=10,
    )
    assert answer.status_code == 424
    assert "cannot reach" in answer.json()["error"]["message"]
