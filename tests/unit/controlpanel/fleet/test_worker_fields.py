"""A worker's key, role and GPU fields as the services set them
(controlpanel.fleet.worker_fields): checked, applied, and audited without the key."""

from __future__ import annotations

import json

import pytest

from controlpanel.fleet import worker_fields
from controlpanel.fleet.errors import InvalidWorkerKey, InvalidWorkerRole, InvalidWorkerURL
from controlpanel.registry.choices import EventKind, WorkerRole, WorkerSource
from controlpanel.registry.models import Event, Worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def worker() -> Worker:
    return Worker.objects.create(url="http://h:1", name="w", source=WorkerSource.OPERATOR)


@pytest.mark.parametrize("bad", ["has space", "tab\there", "é-key", "x" * 513])
def test_a_key_is_printable_ascii_without_spaces(bad: str) -> None:
    with pytest.raises(InvalidWorkerKey):
        worker_fields.api_key(bad)


def test_a_key_is_stripped_and_may_be_empty() -> None:
    assert worker_fields.api_key("  sk-abc~!  ") == "sk-abc~!"
    assert worker_fields.api_key("") == ""


def test_key_changes_are_named_never_shown(worker: Worker) -> None:
    worker_fields.worker_key_event(worker, "sk-1", "ops")
    worker.api_key = "sk-1"
    worker_fields.worker_key_event(worker, "sk-2", "ops")
    worker_fields.worker_key_event(worker, "", "ops")
    events = Event.objects.filter(kind=EventKind.WORKER_KEY_CHANGED).order_by("pk")
    assert [e.data["change"] for e in events] == ["set", "rotated", "removed"]
    assert "sk-" not in json.dumps([e.data for e in events]) + "".join(e.message for e in events)
    assert worker_fields.key_note(worker) == " and an upstream API key"


def test_roles() -> None:
    assert worker_fields.role("prefill") == "prefill"
    with pytest.raises(InvalidWorkerRole, match='"prefill", "decode", "both"'):
        worker_fields.role("Prefill")
    assert worker_fields.role_note(Worker(role=WorkerRole.DECODE)) == " as a decode worker"
    assert worker_fields.role_note(Worker(role=WorkerRole.BOTH)) == ""


def test_a_new_exporter_forgets_the_old_readings(worker: Worker) -> None:
    worker.gpus, worker.gpus_source, worker.gpu_count_max = [{"index": 0}], "dcgm", 1
    changed = worker_fields.dcgm_url_set(worker, "http://h:9400/metrics")
    assert changed[0] == "dcgm_url" and "gpus" in changed
    assert (worker.dcgm_url, worker.gpus, worker.gpus_source) == ("http://h:9400/metrics", [], "")
    with pytest.raises(InvalidWorkerURL):
        worker_fields.dcgm_url("ftp://h")
