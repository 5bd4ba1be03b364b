"""The agents' endpoints: register is idempotent by URL, a heartbeat records the queue and
the NVML readings and brings an offline worker back, an unknown id is a 404 that tells the
agent to register again, deregister drains; bad readings are 422s that change nothing."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.registry.choices import WorkerState
from controlpanel.registry.models import Event, Worker
from tests.support.common import AGENT_HEADERS
from tests.support.in_process import call, error_of
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_other_routers() -> None:
    """A router an earlier end-to-end test left running reports into the same database,
    and a drain waits for the live routers' in-flight counts: only this test's count."""
    routers_only_this_tests()


URL = "http://127.0.0.1:9"


def agent(path: str, body: Any = None) -> Any:
    return call("POST", path, {} if body is None else body, headers=AGENT_HEADERS)


def register(**fields: Any) -> int:
    answer = agent("/api/workers/register", {"url": URL, "kv_events": "", **fields})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert set(body) == {"id", "heartbeat_interval"}
    return int(body["id"])


def test_register_is_idempotent_by_url_and_keeps_one_current_row() -> None:
    first = register(models=["m1"], name="gpu-1", role="decode")
    again = register(models=["m1", {"id": "m2"}])
    assert first == again and Worker.objects.count() == 1
    worker = Worker.objects.get()
    assert (worker.name, worker.role, worker.model_ids) == ("gpu-1", "decode", ["m1", "m2"])
    assert Event.objects.filter(kind="worker_joined").count() == 1


def test_a_heartbeat_records_queue_and_gpus_and_brings_an_offline_worker_back() -> None:
    worker_id = register(models=["m"])
    Worker.objects.filter(pk=worker_id).update(state=WorkerState.OFFLINE)
    gpus = [{"index": 0, "name": "H100", "util": 0.5, "mem_used": 1e9, "mem_total": 8e10}]
    answer = agent(f"/api/workers/{worker_id}/heartbeat", {"queue_length": 3, "gpus": gpus})
    assert answer.status_code == 200
    assert answer.json()["state"] == WorkerState.ACTIVE
    worker = Worker.objects.get(pk=worker_id)
    assert worker.queue_length == 3
    assert [g["name"] for g in worker.gpus] == ["H100"]
    assert Event.objects.filter(kind="worker_back").exists()


@pytest.mark.parametrize(
    "body",
    [
        {"queue_length": -1},
        {"gpus": [{"index": -1}]},
        {"gpus": [{"index": 0, "util": 1.5}]},
        {"gpus": [{"index": 0, "temp": 900}]},
        {"queue_length": "many"},
    ],
)
def test_bad_readings_are_a_422_that_changes_nothing(body: dict[str, Any]) -> None:
    worker_id = register(models=["m"])
    before = Worker.objects.get(pk=worker_id).last_heartbeat
    answer = agent(f"/api/workers/{worker_id}/heartbeat", body)
    assert answer.status_code == 422
    error_of(answer)
    assert Worker.objects.get(pk=worker_id).last_heartbeat == before


def test_an_unknown_worker_is_told_to_register_again() -> None:
    for path in ("/api/workers/424242/heartbeat", "/api/workers/424242/deregister"):
        answer = agent(path)
        assert answer.status_code == 404
        assert error_of(answer)["message"] == "no such worker; register again"


def test_deregister_drains_even_the_last_worker_of_a_model() -> None:
    """Nothing is in flight on it, so the drain completes at once."""
    worker_id = register(models=["m"])
    answer = agent(f"/api/workers/{worker_id}/deregister")
    assert answer.status_code == 200
    assert answer.json()["state"] == WorkerState.DRAINED
    assert Worker.objects.get(pk=worker_id).state == WorkerState.DRAINED


def test_register_refuses_an_unknown_role_or_an_overlong_url() -> None:
    answer = agent("/api/workers/register", {"url": URL, "models": ["m"], "role": "both-ish"})
    assert 400 <= answer.status_code < 500
    error_of(answer)
    long = agent("/api/workers/register", {"url": "http://x/" + "a" * 5000, "models": ["m"]})
    assert long.status_code == 422
    assert not Worker.objects.exists()
