"""The admin's worker endpoints: list and get (never the API key), drain and remove refused
for a model's last routable worker unless forced, activate, patch, and their 4xx answers."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.registry.choices import WorkerSource, WorkerState
from controlpanel.registry.models import Event, Worker
from tests.support.in_process import call, error_of, staff_client

pytestmark = pytest.mark.django_db


def worker(name: str = "w1", model: str = "m", **fields: Any) -> Worker:
    return Worker.objects.create(
        url=f"http://127.0.0.1:9/{name}", name=name, source=WorkerSource.OPERATOR,
        models=[{"id": model}], **fields,
    )  # fmt: skip


def test_list_and_get_show_a_worker_but_never_its_key() -> None:
    one = worker(api_key="sk-secret-value", dcgm_url="http://gpu:9400/metrics")
    listed = call("GET", "/api/workers")
    assert listed.status_code == 200
    (shown,) = listed.json()
    assert "sk-secret-value" not in listed.content.decode()
    assert shown["has_api_key"] is True
    assert shown["models"] == [{"id": "m", "parent": None}]
    assert shown["preflight"]["mismatches"] == {} and shown["gpu_warnings"] == []
    assert call("GET", f"/api/workers/{one.pk}").json()["name"] == "w1"


def test_draining_a_models_last_worker_is_a_409_unless_forced() -> None:
    last = worker()
    refused = call("POST", f"/api/workers/{last.pk}/drain")
    assert refused.status_code == 409
    assert "m" in error_of(refused)["message"]
    assert Worker.objects.get(pk=last.pk).state == WorkerState.ACTIVE
    forced = call("POST", f"/api/workers/{last.pk}/drain?force=1")
    assert forced.status_code == 200
    assert forced.json()["state"] in {WorkerState.DRAINING, WorkerState.DRAINED}
    back = call("POST", f"/api/workers/{last.pk}/activate")
    assert back.status_code == 200 and back.json()["state"] == WorkerState.ACTIVE


def test_a_worker_with_a_peer_drains_and_removes_without_force() -> None:
    one, _peer = worker("w1"), worker("w2")
    assert call("POST", f"/api/workers/{one.pk}/drain").status_code == 200
    removed = call("DELETE", f"/api/workers/{one.pk}")
    assert removed.status_code == 204 and removed.content == b""
    assert list(Worker.objects.values_list("name", flat=True)) == ["w2"]
    assert call("DELETE", f"/api/workers/{one.pk}").status_code == 404


def test_removing_the_last_worker_needs_force() -> None:
    last = worker()
    assert call("DELETE", f"/api/workers/{last.pk}").status_code == 409
    assert call("DELETE", f"/api/workers/{last.pk}?force=true").status_code == 204
    assert not Worker.objects.exists()


def test_patch_changes_only_what_is_sent_and_names_the_actor() -> None:
    one = worker(api_key="sk-old")
    answer = staff_client("patcher").patch(
        f"/api/workers/{one.pk}", {"name": "renamed", "role": "prefill"},
        content_type="application/json",
    )  # fmt: skip
    assert answer.status_code == 200, answer.content
    changed = Worker.objects.get(pk=one.pk)
    assert (changed.name, changed.role, changed.api_key) == ("renamed", "prefill", "sk-old")
    assert Event.objects.filter(actor="user:patcher").exists()
    assert call("PATCH", f"/api/workers/{one.pk}", {"api_key": ""}).json()["has_api_key"] is False


@pytest.mark.parametrize(
    "body", [{"role": "leader"}, {"weight": "heavy"}, {"name": "x" * 10_000}, {"nmae": "x"}]
)
def test_a_bad_patch_is_a_422_that_changes_nothing(body: dict[str, Any]) -> None:
    one = worker()
    answer = call("PATCH", f"/api/workers/{one.pk}", body)
    assert answer.status_code == 422
    error_of(answer)
    assert Worker.objects.get(pk=one.pk).name == "w1"


def test_adding_a_server_that_does_not_answer_is_refused_and_adds_nothing() -> None:
    answer = call("POST", "/api/workers", {"url": "http://127.0.0.1:9"})
    assert 400 <= answer.status_code < 600 and answer.status_code != 500
    assert "127.0.0.1:9" in error_of(answer)["message"]
    assert not Worker.objects.exists()
    assert call("POST", "/api/workers", {"url": "http://x", "role": "leader"}).status_code == 422


def test_lora_input_is_checked_before_any_call_goes_out() -> None:
    one = worker()
    answer = call("POST", f"/api/workers/{one.pk}/loras", {"lora_name": "", "lora_path": "/a"})
    assert answer.status_code == 422
    assert "lora_name" in error_of(answer)["message"]
    missing = call("POST", "/api/workers/424242/loras", {"lora_name": "a", "lora_path": "/a"})
    assert missing.status_code == 404
