"""The operator's fleet page, served by the real ASGI server."""

from __future__ import annotations

import httpx
import pytest

from controlpanel.registry.models import Worker
from tests.support.login import logged_in
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)


def test_fleet_page_needs_a_staff_login(router: RouterServer) -> None:
    response = httpx.get(f"{router.url}/", follow_redirects=False)
    assert response.status_code == 302 and "/admin/login/" in response.headers["location"]


def test_fleet_page_lists_workers_models_and_events(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("llama", loras=("sql-lora",)), name="gpu-one")
    session = logged_in(router)
    page = session.get("/").text
    assert f'data-worker-id="{worker.pk}"' in page
    assert "gpu-one" in page and "sql-lora" in page and "LoRA adapter of llama" in page
    assert "state-active" in page
    assert 'id="model-totals"' in page and "LoRA: sql-lora" in page
    events = session.get("/events/", params={"worker": worker.pk, "kind": "worker_joined"}).text
    assert "added with models llama, sql-lora" in events
    assert "added with models" not in session.get("/events/", params={"kind": "drain_started"}).text
    detail = session.get(f"/workers/{worker.pk}/").text
    assert "Queue (running + waiting)" in detail and "added with models" in detail
    models = session.get("/models/").text
    assert "shortest_queue" in models and "LoRA adapter of llama" in models
    css = session.get("/static/controlpanel/site.css")
    assert css.status_code == 200 and "text/css" in css.headers["content-type"]
    assert session.get("/static/admin/css/base.css").status_code == 200


def test_api_docs_are_served(router: RouterServer) -> None:
    assert httpx.get(f"{router.url}/api/openapi.json").json()["info"]["title"].startswith("vLLM")
    assert httpx.get(f"{router.url}/api/docs").status_code == 200


def test_dashboard_actions_add_drain_activate_remove(
    router: RouterServer, simulator: StartSimulator
) -> None:
    session = logged_in(router)
    sim = simulator("m")
    token = session.cookies["csrftoken"]
    added = session.post(
        "/workers/add", data={"url": sim.url, "name": "w1", "csrfmiddlewaretoken": token}
    )
    assert added.status_code == 302
    page = session.get("/").text
    assert "Added w1, serving m." in page
    worker = Worker.objects.get(name="w1")
    for action, state in (("drain", "drained"), ("activate", "active")):
        response = session.post(
            f"/workers/{worker.pk}/{action}", data={"csrfmiddlewaretoken": token, "force": "1"}
        )
        assert response.status_code == 302
        router.wait_for(lambda seen, s=state: seen[worker.pk]["state"] == s)
    assert (
        session.post(
            f"/workers/{worker.pk}/remove", data={"csrfmiddlewaretoken": token, "force": "1"}
        ).status_code
        == 302
    )
    assert not Worker.objects.filter(pk=worker.pk).exists()
    bad = session.post("/workers/add", data={"url": "not a url", "csrfmiddlewaretoken": token})
    assert bad.status_code == 302
    assert "Could not add not a url" in session.get("/").text
