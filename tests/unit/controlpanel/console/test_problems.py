"""The fleet page's banner: what needs attention, worst first, from the table's own rows:
a model or a LoRA adapter nobody routable serves, a worker down, degraded, failing or
queueing, a GPU warning, and a recent rollback."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.console.dashboard import fleet_rows
from controlpanel.console.problems import fleet_problems, render_problems
from controlpanel.registry.choices import RolloutState, WorkerSource
from controlpanel.registry.models import Alias, RolloutPlan, Worker

pytestmark = pytest.mark.django_db


def worker(name: str, models: list[dict[str, Any]], **fields: Any) -> Worker:
    return Worker.objects.create(
        url=f"http://127.0.0.1:9/{name}", name=name, source=WorkerSource.OPERATOR,
        models=models, last_heartbeat=timezone.now(), **fields,
    )  # fmt: skip


def texts() -> list[tuple[str, str]]:
    return [(p.severity, p.text) for p in fleet_problems(fleet_rows())]


def test_a_healthy_fleet_has_no_problems() -> None:
    worker("w1", [{"id": "m"}, {"id": "m-lora", "parent": "m"}])
    assert texts() == []


def test_models_and_adapters_without_a_routable_worker_come_first() -> None:
    worker("w1", [{"id": "m"}], metrics={"waiting": 100})
    worker("w2", [{"id": "m"}, {"id": "ad", "parent": "m"}], state="offline")
    worker("w3", [{"id": "lone"}], state="unhealthy", last_error="connection refused")
    found = texts()
    assert found[0][0] == "bad" and found[-1][0] == "warn"
    assert ("bad", "lone: no routable worker (1 registered); requests get 503") in found
    assert ("bad", "ad (LoRA adapter of m): no routable worker (1 registered); requests for "
            "it get 503") in found  # fmt: skip
    assert ("bad", "w2 offline: no heartbeat") in found
    assert ("bad", "w3 unhealthy: connection refused") in found
    assert ("warn", "w1: 100 requests waiting in vLLM's queue") in found
    assert not any(text.startswith("m:") for _, text in found)  # m still has w1


def test_an_adapter_is_not_listed_when_its_base_has_no_worker_either() -> None:
    worker("w1", [{"id": "m"}, {"id": "ad", "parent": "m"}], state="offline")
    assert [t for _, t in texts() if "LoRA" in t] == []


def test_degraded_and_gpu_warnings_link_to_the_worker() -> None:
    one = worker("w1", [{"id": "m"}], state="degraded", degraded_reason="60% failed",
                 gpu_warnings=[{"key": "temp", "message": "GPU 0 at 91 °C"}])  # fmt: skip
    problems = fleet_problems(fleet_rows())
    assert [(p.severity, p.text) for p in problems][1:] == [
        ("bad", "w1 degraded: 60% failed"),
        ("warn", "w1: GPU 0 at 91 °C"),
    ]
    assert problems[-1].href == f"/workers/{one.pk}/#gpus"
    assert "GPU 0 at 91 °C" in render_problems(fleet_rows())


def test_a_recent_rollback_is_a_problem_and_an_old_one_is_not() -> None:
    worker("w1", [{"id": "m"}])
    alias = Alias.objects.create(name="chat", targets={"m": 100})
    state = RolloutState.ROLLED_BACK
    plan = RolloutPlan.objects.create(
        alias=alias, from_target="m", to_target="n", steps=[], state=state, reason="errors 30%"
    )
    assert texts() == [("bad", f"Rollout #{plan.pk} of chat rolled back: errors 30%")]
    RolloutPlan.objects.filter(pk=plan.pk).update(updated_at=timezone.now() - timedelta(hours=7))
    assert texts() == []
