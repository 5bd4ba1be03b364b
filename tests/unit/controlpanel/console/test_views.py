"""The operator's pages, in process: staff only, the fleet, worker, models and events pages
showing the registry's state, and the worker actions and their refusals as messages."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlpanel.registry.choices import WorkerSource, WorkerState
from controlpanel.registry.models import Event, ServedModel, Worker
from tests.support.in_process import staff_client

pytestmark = pytest.mark.django_db


def worker(name: str, models: list[dict[str, Any]], **fields: Any) -> Worker:
    return Worker.objects.create(
        url=f"http://127.0.0.1:9/{name}", name=name, source=WorkerSource.OPERATOR,
        models=models, last_heartbeat=timezone.now(), **fields,
    )  # fmt: skip


def text(page: Any) -> str:
    assert page.status_code == 200, page.status_code
    return str(page.content.decode())


def test_the_pages_are_for_staff_only() -> None:
    for path in ("/", "/models/", "/events/", "/rollouts/", "/keys/", "/usage/"):
        answer = Client().get(path)
        assert answer.status_code == 302 and "/admin/login/" in answer["Location"]
    one = worker("w1", [{"id": "m"}])
    assert Client().post(f"/workers/{one.pk}/drain").status_code == 302
    assert Worker.objects.get(pk=one.pk).state == WorkerState.ACTIVE


def test_the_fleet_page_shows_workers_models_and_problems() -> None:
    worker("gpu-a", [{"id": "llama-8b"}])
    worker("gpu-b", [{"id": "qwen-7b"}], state=WorkerState.OFFLINE)
    page = text(staff_client().get("/"))
    assert "gpu-a" in page and "gpu-b" in page and "llama-8b" in page
    assert "qwen-7b: no routable worker (1 registered); requests get 503" in page
    assert "http://testserver/v1" in page


def test_the_worker_page_and_a_missing_worker() -> None:
    one = worker("gpu-a", [{"id": "llama-8b"}])
    Event.objects.create(kind="worker_joined", worker=one, message="registered with llama-8b")
    browser = staff_client()
    page = text(browser.get(f"/workers/{one.pk}/", {"range": "6h"}))
    assert "gpu-a" in page and "registered with llama-8b" in page
    assert text(browser.get(f"/workers/{one.pk}/", {"range": "nonsense"}))
    assert browser.get("/workers/424242/").status_code == 404


def test_draining_the_last_worker_asks_first_then_a_confirmed_drain_goes() -> None:
    one = worker("gpu-a", [{"id": "m"}])
    browser = staff_client()
    refused = browser.post(f"/workers/{one.pk}/drain", follow=True)
    assert "gpu-a not changed" in text(refused)
    assert Worker.objects.get(pk=one.pk).state == WorkerState.ACTIVE
    browser.post(f"/workers/{one.pk}/drain", {"force": "1"})
    assert Worker.objects.get(pk=one.pk).state != WorkerState.ACTIVE
    assert Event.objects.filter(actor="user:op").exists()
    browser.post(f"/workers/{one.pk}/activate")
    assert Worker.objects.get(pk=one.pk).state == WorkerState.ACTIVE
    assert browser.get(f"/workers/{one.pk}/drain").status_code == 405


def test_a_bulk_drain_skips_the_last_worker_and_ignores_junk_ids() -> None:
    a, _ = worker("a", [{"id": "m"}]), worker("b", [{"id": "m"}])
    lone = worker("lone", [{"id": "n"}])
    ids = [str(a.pk), str(lone.pk), "²", "x", "9" * 30]
    page = text(staff_client().post("/workers/bulk", {"action": "drain", "worker": ids},
                                    follow=True))  # fmt: skip
    assert "lone not changed" in page
    states = dict(Worker.objects.values_list("name", "state"))
    assert states["lone"] == WorkerState.ACTIVE and states["a"] != WorkerState.ACTIVE
    assert states["b"] == WorkerState.ACTIVE
    empty = staff_client("op2").post("/workers/bulk", {"action": "explode"}, follow=True)
    assert "Select at least one worker" in text(empty)


def test_adding_a_worker_that_does_not_answer_keeps_what_was_typed() -> None:
    browser = staff_client()
    body = {"url": "http://127.0.0.1:9", "name": "typed-name", "api_key": "sk-secret"}
    page = text(browser.post("/workers/add", body, follow=True))
    assert "Could not add http://127.0.0.1:9" in page
    assert 'value="typed-name"' in page and "sk-secret" not in page
    assert not Worker.objects.exists()


def test_the_models_page_sets_a_policy_and_keeps_a_refused_config() -> None:
    worker("gpu-a", [{"id": "m"}])
    ServedModel.objects.create(name="m")
    browser = staff_client()
    browser.post("/models/policy", {"model": "m", "policy": "round_robin"})
    assert ServedModel.objects.get(name="m").policy == "round_robin"
    bad = {"model": "m", "policy": "power_of_two", "policy_config": "[1, 2]"}
    page = text(browser.post("/models/policy", bad, follow=True))
    assert "Policy of m not changed: the configuration must be a JSON object" in page
    assert ServedModel.objects.get(name="m").policy == "round_robin"
    missing = browser.post("/models/policy", {"model": "nope", "policy": "random"}, follow=True)
    assert "No model named nope." in text(missing)


def test_the_events_page_filters_and_serves_only_rows_to_the_live_page() -> None:
    Event.objects.create(kind="worker_offline", message="gpu-a went away")
    Event.objects.create(kind="policy_changed", message="m: shortest_queue -> random")
    browser = staff_client()
    page = text(browser.get("/events/", {"severity": "bad"}))
    assert "gpu-a went away" in page and "shortest_queue -&gt; random" not in page
    first = Event.objects.order_by("pk").first()
    assert first is not None
    rows = text(browser.get("/events/", {"partial": "1", "after": str(first.pk)}))
    assert "shortest_queue -&gt; random" in rows and "gpu-a went away" not in rows
    assert "<html" not in rows
