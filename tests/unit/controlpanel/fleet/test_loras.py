"""LoRA adapters loaded and unloaded through the control plane (controlpanel.fleet.loras),
against a real HTTP server in this process standing in for the vLLM worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlpanel.fleet import loras
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, ServedModel, Worker
from tests.support.http_peer import HttpPeer, http_peer
from tests.support.servers import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    with http_peer() as server:
        server.models("base")
        yield server


def worker_at(url: str) -> Worker:
    return Worker.objects.create(
        url=url,
        name="w",
        source="operator",
        api_key="sk-up",
        models=[{"id": "base", "root": "base", "parent": None}],  # as the peer lists it
    )


def test_a_loaded_adapter_is_routed_from_the_workers_own_list(peer: HttpPeer) -> None:
    worker = worker_at(peer.url)
    peer.answer("/v1/load_lora_adapter", "Success: LoRA adapter 'sql' added successfully.")
    listed = [{"id": "base"}, {"id": "sql", "parent": "base"}]
    peer.answer("/v1/models", {"object": "list", "data": listed})
    loaded = loras.worker_load_lora(worker_id=worker.pk, name="sql", path="/l/sql", actor="ops")
    assert loaded.model_ids == ["base", "sql"]
    assert ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/l/sql"}) in peer.posted
    assert all(h["Authorization"] == "Bearer sk-up" for _, h in peer.seen)
    assert ServedModel.objects.filter(name="sql").exists()
    event = Event.objects.get(kind=EventKind.MODELS_CHANGED)
    assert event.message == "LoRA adapter sql loaded from /l/sql; models now base, sql"


def test_an_unload_the_list_does_not_show_says_unchanged(peer: HttpPeer) -> None:
    worker = worker_at(peer.url)
    peer.answer("/v1/unload_lora_adapter", "ok")
    loras.worker_unload_lora(worker_id=worker.pk, name="sql", actor="ops")
    assert peer.posted == [("/v1/unload_lora_adapter", {"lora_name": "sql"})]
    message = Event.objects.get(kind=EventKind.MODELS_CHANGED).message
    assert message == "LoRA adapter sql unloaded; models now base (unchanged)"


def test_the_workers_refusal_is_passed_on_in_its_words(peer: HttpPeer) -> None:
    worker = worker_at(peer.url)
    error = {"error": {"message": "The lora adapter 'sql' has already been loaded."}}
    peer.answer("/v1/load_lora_adapter", error, status=400)
    with pytest.raises(loras.LoraRefused, match="w refused: HTTP 400 The lora adapter 'sql'"):
        loras.worker_load_lora(worker_id=worker.pk, name="sql", path="/l", actor="ops")
    peer.answer("/v1/unload_lora_adapter", "plain text refusal", status=404)
    with pytest.raises(loras.LoraRefused, match="HTTP 404 plain text refusal"):
        loras.worker_unload_lora(worker_id=worker.pk, name="sql", actor="ops")
    assert not Event.objects.exists()


def test_a_worker_not_there_is_a_failed_dependency() -> None:
    worker = worker_at(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(loras.LoraUnreachable, match="cannot reach") as caught:
        loras.worker_unload_lora(worker_id=worker.pk, name="sql", actor="ops")
    assert caught.value.status == 424
