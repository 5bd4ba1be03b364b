"""The fleet table's rows and totals, read from the registry: the live routers' in-flight
and failure counts summed over every router, rates unknown (not zero) without a router,
a worker's sole models, per-model totals and roles, and each cell's colour."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.console import dashboard
from controlpanel.registry.choices import WorkerRole, WorkerSource
from controlpanel.registry.models import RouterInstance, Worker, WorkerSample
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_other_routers() -> None:
    """Only this test's routers: a router an earlier end-to-end test of the same session
    left running reports into the same database (as tests/unit/controlpanel/routers does)."""
    routers_only_this_tests()


def worker(name: str, models: list[dict[str, Any]], **fields: Any) -> Worker:
    return Worker.objects.create(
        url=f"http://127.0.0.1:9/{name}", name=name, source=WorkerSource.OPERATOR,
        models=models, last_heartbeat=timezone.now(), **fields,
    )  # fmt: skip


def router(instance: str, inflight: dict[str, int], window: dict[str, list[int]]) -> None:
    now = timezone.now()
    RouterInstance.objects.create(
        instance_id=instance, hostname="h", pid=1, started_at=now, last_seen=now,
        inflight=inflight, window=window,
    )  # fmt: skip


def test_without_a_router_rates_are_unknown_not_zero() -> None:
    worker("w1", [{"id": "m"}])
    (row,) = dashboard.fleet_rows()
    assert row.inflight == 0 and row.routable
    assert row.metrics["error_rate"] is None and row.metrics["router_rps"] is None
    assert row.sole_models == ["m"]


def test_the_routers_reports_are_summed_and_a_stale_one_ignored() -> None:
    one = worker("w1", [{"id": "m"}])
    worker("w2", [{"id": "m"}, {"id": "m-lora", "parent": "m"}], state="draining")
    router("r1", {str(one.pk): 2}, {str(one.pk): [10, 1, 30]})
    router("r2", {str(one.pk): 1}, {str(one.pk): [10, 3]})  # an older report: no rate
    router("r3", {str(one.pk): 50}, {})
    RouterInstance.objects.filter(instance_id="r3").update(
        last_seen=timezone.now() - timedelta(minutes=5)
    )
    rows = {r.worker.name: r for r in dashboard.fleet_rows()}
    assert rows["w1"].inflight == 3
    assert rows["w1"].metrics["error_rate"] == pytest.approx(0.2)
    assert rows["w1"].metrics["window_requests"] == 20
    assert rows["w1"].metrics["router_rps"] > 0
    assert rows["w2"].metrics["router_rps"] == 0.0  # a live router saw none: zero is known
    assert rows["w1"].sole_models == ["m"] and rows["w2"].sole_models == []
    (total,) = dashboard.model_totals(list(rows.values()))
    assert (total.name, total.workers, total.routable, total.inflight) == ("m", 2, 1, 3)
    assert total.loras == {"m-lora"}


def test_the_sparkline_skips_unknown_samples() -> None:
    one = worker("w1", [{"id": "m"}])
    now = timezone.now()
    for seconds, running in ((30, 1), (20, None), (10, 3)):
        WorkerSample.objects.create(worker=one, at=now - timedelta(seconds=seconds), up=True,
                                    running=running, waiting=0 if running else None)  # fmt: skip
    (row,) = dashboard.fleet_rows()
    assert len(row.sparkline.split()) == 2
    assert dashboard.sparkline_points([None, 1.0]) == ""


def test_roles_are_counted_only_for_a_disaggregated_model() -> None:
    worker("p", [{"id": "m"}], role=WorkerRole.PREFILL)
    worker("d", [{"id": "m"}], role=WorkerRole.DECODE)
    worker("b", [{"id": "n"}])
    totals = {t.name: t for t in dashboard.model_totals(dashboard.fleet_rows())}
    assert totals["m"].roles == "1 prefill · 1 decode"
    assert totals["n"].roles == ""


def test_each_cell_is_coloured_by_its_threshold(settings: pytest.FixtureRequest) -> None:
    settings.CONTROLPANEL_WARN_WAITING = 8  # type: ignore[attr-defined]
    settings.CONTROLPANEL_WARN_ERROR_RATE = 0.05  # type: ignore[attr-defined]
    settings.CONTROLPANEL_DEGRADED_ERROR_RATE = 0.5  # type: ignore[attr-defined]
    one = worker("w1", [{"id": "m"}], metrics={"waiting": 40, "kv_cache_usage": 0.95},
                 gpu_warnings=[{"key": "xid", "message": "XID 79"}])  # fmt: skip
    (row,) = dashboard.fleet_rows()
    row.metrics["error_rate"] = 0.06
    assert row.severity == {"state": "", "errors": "warn", "waiting": "bad", "kv": "warn",
                            "gpus": "warn"}  # fmt: skip
    assert row.worst == "bad"
    Worker.objects.filter(pk=one.pk).update(state="draining", metrics={}, gpu_warnings=[])
    (quiet,) = dashboard.fleet_rows()
    assert quiet.severity["state"] == "warn" and quiet.worst == "warn"
    Worker.objects.filter(pk=one.pk).update(state="active", sleeping=True)
    (asleep,) = dashboard.fleet_rows()
    assert asleep.severity["state"] == "bad" and not asleep.routable
