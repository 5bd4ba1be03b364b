"""Probe results and routers' failure reports turned into registry state
(controlpanel.fleet.health): hysteresis both ways, only active <-> unhealthy, models and
sleep tracked, and one real round against an HTTP server in this process."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from controlpanel.fleet import health, probes
from controlpanel.registry.choices import EventKind, WorkerState
from controlpanel.registry.models import (
    Event,
    RoutingGeneration,
    ServedModel,
    Worker,
    WorkerSample,
)
from tests.support.http_peer import HttpPeer, http_peer
from tests.support.probes import bare_worker, events, fresh
from tests.support.recorded_metrics import NEW_MODEL, RECORDED_NEW, sleep_lines

pytestmark = pytest.mark.django_db

UNHEALTHY_AFTER = settings.CONTROLPANEL_UNHEALTHY_AFTER
HEALTHY_AFTER = settings.CONTROLPANEL_HEALTHY_AFTER


@pytest.fixture
def worker() -> Worker:
    return bare_worker("http://10.0.0.1:8000", "m")


def result(worker: Worker, *, up: bool = True, **fields: Any) -> probes.ProbeResult:
    fields.setdefault("metrics_text", None)
    fields.setdefault("models_read", False)
    return probes.ProbeResult(
        worker_id=worker.pk, at=time.time(), up=up, error="" if up else "refused", **fields
    )


def apply(worker: Worker, times: int = 1, **fields: Any) -> Worker:
    for _ in range(times):
        assert health.probe_result_apply(result=result(worker, **fields))
    return fresh(worker)


def test_a_worker_leaves_after_enough_failures_and_returns_after_enough_successes(
    worker: Worker,
) -> None:
    assert apply(worker, UNHEALTHY_AFTER - 1, up=False).state == WorkerState.ACTIVE
    down = apply(worker, up=False)
    assert down.state == WorkerState.UNHEALTHY
    assert down.consecutive_failures == UNHEALTHY_AFTER and down.last_error == "refused"
    assert events(EventKind.WORKER_UNHEALTHY, worker)[0].message.startswith(
        f"{UNHEALTHY_AFTER} failed probe"
    )
    assert apply(worker, HEALTHY_AFTER - 1).state == WorkerState.UNHEALTHY
    back = apply(worker)
    assert back.state == WorkerState.ACTIVE and back.last_error == ""
    assert (back.consecutive_failures, back.consecutive_successes) == (0, HEALTHY_AFTER)
    assert len(events(EventKind.WORKER_RECOVERED, worker)) == 1


def test_probes_never_change_an_operators_state(worker: Worker) -> None:
    Worker.objects.filter(pk=worker.pk).update(state=WorkerState.DRAINING)
    drained = apply(worker, UNHEALTHY_AFTER + 1, up=False)
    assert drained.state == WorkerState.DRAINING
    assert drained.consecutive_failures == UNHEALTHY_AFTER + 1
    assert not events(EventKind.WORKER_UNHEALTHY, worker)


def test_a_removed_worker_drops_its_result(worker: Worker) -> None:
    gone = result(worker)
    worker.delete()
    assert health.probe_result_apply(result=gone) is False


def test_a_changed_model_list_is_stored_and_announced(worker: Worker) -> None:
    payload = {"object": "list", "data": [{"id": "m2"}, {"id": "m3"}]}
    changed = apply(worker, models_read=True, models_payload=payload)
    assert changed.model_ids == ["m2", "m3"]
    assert changed.scrape_state["probes_since_models"] == 0
    assert {"m2", "m3"} <= set(ServedModel.objects.values_list("name", flat=True))
    (event,) = events(EventKind.MODELS_CHANGED, worker)
    assert event.message == "models now m2, m3; added m2, m3; removed m"
    # a failed read keeps the list and counts on, so the next probe asks again
    kept = apply(worker, models_read=True, models_payload={"error": "x"})
    assert kept.model_ids == ["m2", "m3"] and kept.scrape_state["probes_since_models"] == 1
    targets = {t.worker_id: t.read_models for t in health.probe_targets()}
    assert targets[worker.pk] is (settings.CONTROLPANEL_MODELS_EVERY <= 1 + 1)


def test_sleep_is_tracked_and_unknown_keeps_what_was_known(worker: Worker) -> None:
    asleep = apply(worker, metrics_text=RECORDED_NEW + sleep_lines(0, 1, 0))
    assert asleep.sleeping is True
    assert apply(worker, metrics_text=None).sleeping is True  # unreadable: still asleep
    awake = apply(worker, metrics_text=RECORDED_NEW + sleep_lines(1, 0, 0))
    assert awake.sleeping is False
    kinds = Event.objects.filter(worker=worker).values_list("kind", flat=True)
    assert list(kinds.order_by("pk")) == [EventKind.WORKER_SLEEPING, EventKind.WORKER_AWAKE]


def test_the_queue_is_running_plus_waiting_and_unknown_keeps_the_last(worker: Worker) -> None:
    loaded = apply(worker, metrics_text=RECORDED_NEW)
    assert loaded.queue_length == 6 and loaded.metrics["running"] == 4
    unknown = apply(worker, metrics_text=None)
    assert unknown.queue_length == 6 and unknown.metrics["running"] is None
    assert WorkerSample.objects.filter(worker=worker).count() == 2


def test_a_refused_connection_makes_a_worker_unhealthy_at_once(worker: Worker) -> None:
    assert health.worker_passive_failures(worker_id=worker.pk, failures=1, cause="reset: x") is (
        UNHEALTHY_AFTER == 1
    )
    made = health.worker_passive_failures(worker_id=worker.pk, failures=1, cause="connect: no")
    assert made is True
    down = fresh(worker)
    assert down.state == WorkerState.UNHEALTHY
    assert down.last_error == "1 failed request: connect: no (2 failures in a row)"
    again = health.worker_passive_failures(worker_id=worker.pk, failures=1, cause="connect: no")
    assert again is False  # already unhealthy: no second event
    assert len(events(EventKind.WORKER_UNHEALTHY, worker)) == 1
    assert health.worker_passive_failures(worker_id=worker.pk, failures=0, cause="x") is False
    assert health.worker_passive_failures(worker_id=10**9, failures=1, cause="x") is False


def test_history_older_than_the_window_is_pruned(worker: Worker) -> None:
    now = timezone.now()
    old = now - timedelta(minutes=settings.CONTROLPANEL_HISTORY_MINUTES + 1)
    for at in (old, now):
        WorkerSample.objects.create(worker=worker, at=at, up=True)
    assert health.samples_prune(now=now) == 1
    assert list(WorkerSample.objects.values_list("at", flat=True)) == [now]


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    with http_peer() as server:
        server.answer("/health", "")
        server.answer("/metrics", RECORDED_NEW, content_type="text/plain")
        server.models(NEW_MODEL)
        yield server


def test_a_real_round_reads_health_metrics_and_models(peer: HttpPeer) -> None:
    worker = bare_worker(peer.url, NEW_MODEL)
    Worker.objects.filter(pk=worker.pk).update(consecutive_failures=2, last_error="was down")
    targets = [t for t in health.probe_targets() if t.worker_id == worker.pk]
    (probed,) = probes.probe_many(targets, timeout=30)
    assert probed.up and probed.models_read
    assert health.probe_result_apply(result=probed)
    read = fresh(worker)
    assert (read.consecutive_failures, read.last_error, read.queue_length) == (0, "", 6)
    assert read.last_probe_at is not None and read.state == WorkerState.ACTIVE
    assert {p for p, _ in peer.seen} >= {"/health", "/metrics", "/v1/models"}
    peer.answer("/health", "engine dead", status=503)
    (failed,) = probes.probe_many(targets, timeout=30)
    health.probe_result_apply(result=failed)
    assert fresh(worker).consecutive_failures == 1


def test_a_round_is_skipped_while_another_holds_the_lock() -> None:
    mine = cache.add(health.ROUND_LOCK_KEY, True, timeout=60)  # or another process's round
    try:
        assert health.workers_probe() == 0
    finally:
        if mine:
            cache.delete(health.ROUND_LOCK_KEY)


def test_a_round_that_changes_nothing_routers_read_leaves_the_generation(peer: HttpPeer) -> None:
    bare_worker(peer.url, NEW_MODEL)
    # The first rounds fill in what needs two readings (rates are deltas of counters).
    for _ in range(2):
        assert health.workers_probe() == 1
    settled = RoutingGeneration.current()
    assert health.workers_probe() == 1  # the same page again: only times and counts move
    assert RoutingGeneration.current() == settled
    busier = re.sub(r"(vllm:num_requests_running\{[^}]*\}) 3\.0", r"\1 5.0", RECORDED_NEW)
    assert busier != RECORDED_NEW
    peer.answer("/metrics", busier, content_type="text/plain")  # two more requests running
    assert health.workers_probe() == 1
    assert RoutingGeneration.current() != settled


def test_an_idle_round_leaves_pruning_and_preflight_for_later(
    peer: HttpPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(health, "samples_prune", lambda: calls.append("prune") or 0)
    monkeypatch.setattr(health.preflight, "pools_preflight", lambda: calls.append("preflight"))
    bare_worker(peer.url, NEW_MODEL)
    for _ in range(3):  # the first rounds change what needs two readings
        health.workers_probe()
    calls.clear()
    health.workers_probe()  # the same page again, the same workers, within the minute
    assert calls == []
    bare_worker("http://127.0.0.1:1", NEW_MODEL)  # a new set of workers (refused at once)
    health.workers_probe()
    assert calls == ["preflight"]
    calls.clear()
    health.PRUNE_TIMER.last = health.PREFLIGHT_TIMER.last = time.monotonic() - 61
    Worker.objects.filter(url="http://127.0.0.1:1").delete()
    health.workers_probe()  # a minute later (and the set changed back): both
    assert calls == ["prune", "preflight"]


def test_an_idle_round_writes_only_what_moved(peer: HttpPeer) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    worker = bare_worker(peer.url, NEW_MODEL)
    for _ in range(3):  # rates need two readings; the third reads as the second
        health.workers_probe()
    before = fresh(worker)
    with CaptureQueriesContext(connection) as queries:
        assert health.workers_probe() == 1
    (update,) = [q["sql"] for q in queries if q["sql"].startswith('UPDATE "controlpanel_worker"')]
    assert '"metrics"' not in update and '"models"' not in update  # the same page as last time
    assert '"last_probe_at"' in update and '"scrape_state"' in update
    after = fresh(worker)
    assert after.metrics == before.metrics and after.last_probe_at != before.last_probe_at
    by_pk = '"controlpanel_worker"."id" = '
    (locked,) = [q["sql"] for q in queries if q["sql"].startswith("SELECT") and by_pk in q["sql"]]
    assert "ORDER BY" not in locked  # one fixed SELECT (... FOR UPDATE where the database has it)
