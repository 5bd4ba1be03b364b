"""Pool preflight on the pages: each worker's differences per model as the page words
them, accepted or keeping it out (a "refuse" model with an unaccepted difference); the
preflight mode form and the accept button; no router here: no recent decisions."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from controlpanel.console import pool_views
from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import ServedModel, Worker
from tests.support.in_process import staff_client

pytestmark = pytest.mark.django_db
BLOCK = {"field": "block_size", "value": 16, "pool": 32}


def worker(name: str, mismatches: dict[str, Any], **fields: Any) -> Worker:
    return Worker.objects.create(
        url=f"http://127.0.0.1:9/{name}", name=name, models=[{"id": m} for m in mismatches],
        source=WorkerSource.OPERATOR, last_heartbeat=timezone.now(),
        preflight={"mismatches": mismatches}, **fields,
    )  # fmt: skip


def test_differences_are_worded_and_refuse_only_where_the_model_says_so() -> None:
    ServedModel.objects.create(name="strict", preflight="refuse")
    ServedModel.objects.create(name="lax", preflight="warn")
    odd = worker("odd", {"strict": [BLOCK], "lax": [BLOCK]})
    found = pool_views.pool_differences([odd])
    assert [(d["texts"], d["accepted"], d["refused"]) for d in found["strict"]] == [
        (["block_size 16 vs pool 32"], False, True),
    ]  # fmt: skip
    assert found["lax"][0]["refused"] is False
    by_model = {d["model"]: d["refused"] for d in pool_views.worker_differences(odd)}
    assert by_model == {"strict": True, "lax": False}


def test_an_accepted_difference_no_longer_keeps_the_worker_out() -> None:
    ServedModel.objects.create(name="strict", preflight="refuse")
    odd = worker("odd", {"strict": [BLOCK]}, preflight_accepted=["strict|block_size|16"])
    (shown,) = pool_views.worker_differences(odd)
    assert shown["accepted"] and not shown["refused"]


def test_the_accept_button_and_the_mode_form() -> None:
    ServedModel.objects.create(name="strict", preflight="warn")
    odd = worker("odd", {"strict": [BLOCK]})
    browser = staff_client()
    accepted = browser.post(f"/workers/{odd.pk}/preflight/accept", follow=True)
    assert "odd: its differences from the pool are accepted." in accepted.content.decode()
    assert Worker.objects.get(pk=odd.pk).preflight_accepted == ["strict|block_size|16"]
    missing = browser.post("/workers/424242/preflight/accept", follow=True)
    assert "No such worker." in missing.content.decode()
    browser.post("/models/preflight", {"model": "strict", "preflight": "refuse"})
    assert ServedModel.objects.get(name="strict").preflight == "refuse"
    bad = browser.post("/models/preflight", {"model": "strict", "preflight": "maybe"}, follow=True)
    assert "Preflight of strict not changed" in bad.content.decode()
    gone = browser.post("/models/preflight", {"model": "nope", "preflight": "warn"}, follow=True)
    assert "No model named nope." in gone.content.decode()


def test_no_router_in_this_process_means_no_recent_decisions() -> None:
    assert pool_views.recent_decisions() == {}
