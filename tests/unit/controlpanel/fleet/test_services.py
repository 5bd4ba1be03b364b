"""The worker lifecycle services (controlpanel.fleet.services) on the test database, with a
real HTTP server in this process (tests.support.http_peer) where a service asks the worker
what it serves."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from controlpanel.fleet import services
from controlpanel.fleet.errors import (
    InvalidWeight,
    InvalidWorkerRole,
    InvalidWorkerURL,
    LastRoutableWorker,
    WorkerAlreadyExists,
)
from controlpanel.registry.choices import EventKind, WorkerSource, WorkerState
from controlpanel.registry.models import (
    Event,
    RouterInstance,
    RoutingGeneration,
    ServedModel,
    Worker,
)
from tests.support.http_peer import HttpPeer, http_peer
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    with http_peer() as server:
        server.models("base", "other")
        yield server


@pytest.fixture(autouse=True)
def no_routers() -> None:
    routers_only_this_tests()


def kinds(worker: Worker | None = None) -> list[str]:
    events = Event.objects.order_by("pk")
    return list((events.filter(worker=worker) if worker else events).values_list("kind", flat=True))


def router(instance: str, *, generation: int, inflight: dict[str, int]) -> None:
    now = timezone.now()
    RouterInstance.objects.update_or_create(
        instance_id=instance,
        defaults={"hostname": "h", "pid": 1, "started_at": now, "last_seen": now,
                  "generation": generation, "inflight": inflight},
    )  # fmt: skip


def agent_worker(url: str = "http://10.0.0.9:8000", **fields: object) -> Worker:
    return services.worker_register(url=url, models=["m"], kv_events="", **fields)  # type: ignore[arg-type]


def test_an_added_worker_is_discovered_normalised_and_announced(peer: HttpPeer) -> None:
    before = RoutingGeneration.current()
    worker = services.worker_add(url=f"{peer.url.upper()}/v1/", api_key="sk-up", actor="ops")
    assert worker.url == peer.url and worker.name == peer.url.split("://")[1]
    assert worker.model_ids == ["base", "other"] and worker.source == WorkerSource.OPERATOR
    assert set(ServedModel.objects.values_list("name", flat=True)) >= {"base", "other"}
    assert RoutingGeneration.current() != before
    joined = Event.objects.get(kind=EventKind.WORKER_JOINED, worker=worker)
    assert "added with models base, other and an upstream API key" in joined.message
    assert joined.data["after"]["api_key"] == "set" and "sk-up" not in str(joined.data)
    assert ("/v1/models", "Bearer sk-up") in [(p, h.get("Authorization")) for p, h in peer.seen]


def test_a_worker_is_added_once_and_bad_input_is_refused_before_any_call(peer: HttpPeer) -> None:
    services.worker_add(url=peer.url, actor="ops")
    asked = len(peer.seen)
    with pytest.raises(WorkerAlreadyExists):
        services.worker_add(url=f"{peer.url}/", actor="ops")
    with pytest.raises(InvalidWorkerURL):
        services.worker_add(url="ftp://host", actor="ops")
    with pytest.raises(InvalidWorkerRole):
        services.worker_add(url="http://10.9.9.9:1", role="leader", actor="ops")
    assert len(peer.seen) == asked
    assert Worker.objects.count() == 1


def test_registering_again_updates_the_one_row(peer: HttpPeer) -> None:
    first = services.worker_register(url=peer.url, models=["a"], api_key="sk-1", kv_events="")
    Worker.objects.filter(pk=first.pk).update(state=WorkerState.OFFLINE, weight=3.0)
    again = services.worker_register(url=peer.url, models=["a", "b"])  # key None: kept
    assert again.pk == first.pk and Worker.objects.count() == 1
    assert again.state == WorkerState.ACTIVE and again.model_ids == ["a", "b"]
    assert again.api_key == "sk-1" and again.weight == 3.0
    assert kinds(again) == [
        EventKind.WORKER_JOINED,
        EventKind.MODELS_CHANGED,
        EventKind.WORKER_BACK,
    ]


def test_registering_without_models_asks_the_server_with_the_rows_key(peer: HttpPeer) -> None:
    services.worker_register(url=peer.url, models=["base"], api_key="sk-row", kv_events="")
    worker = services.worker_register(url=peer.url)
    assert worker.model_ids == ["base", "other"]
    asked = [headers.get("Authorization") for path, headers in peer.seen if path == "/v1/models"]
    assert asked == ["Bearer sk-row"]


def test_a_heartbeat_brings_an_offline_worker_back_and_keeps_its_queue() -> None:
    worker = agent_worker()
    Worker.objects.filter(pk=worker.pk).update(state=WorkerState.OFFLINE)
    beat = services.worker_heartbeat(worker_id=worker.pk, queue_length=4)
    assert beat.state == WorkerState.ACTIVE and beat.queue_length == 4
    assert beat.queue_length_at == beat.last_heartbeat
    assert kinds(worker)[-1] == EventKind.WORKER_BACK
    with pytest.raises(Worker.DoesNotExist):
        services.worker_heartbeat(worker_id=worker.pk + 1000)


def test_stale_agents_go_offline_and_operators_workers_do_not() -> None:
    stale = agent_worker("http://10.0.0.1:8000")
    fresh = agent_worker("http://10.0.0.2:8000")
    operator = Worker.objects.create(url="http://10.0.0.3:8000", name="op", source="operator")
    long_ago = timezone.now() - timedelta(seconds=settings.CONTROLPANEL_HEARTBEAT_EXPIRY + 5)
    Worker.objects.filter(pk__in=[stale.pk, operator.pk]).update(last_heartbeat=long_ago)
    assert services.workers_expire_heartbeats() == 1
    assert services.workers_expire_heartbeats() == 0  # once
    states = dict(Worker.objects.values_list("pk", "state"))
    assert states == {stale.pk: "offline", fresh.pk: "active", operator.pk: "active"}
    assert kinds(stale)[-1] == EventKind.WORKER_OFFLINE


def test_a_drain_finishes_when_every_router_knows_and_has_nothing_in_flight() -> None:
    worker = agent_worker()
    agent_worker("http://10.0.0.8:8000")  # another worker of "m": not the last one
    router("r1", generation=0, inflight={})
    drained = services.worker_drain(worker_id=worker.pk, actor="ops", refuse_last=True)
    assert drained.state == WorkerState.DRAINING  # r1 reported from an older snapshot
    needed = drained.drain_generation
    assert needed == RoutingGeneration.current()
    router("r1", generation=needed, inflight={str(worker.pk): 2})
    assert services.workers_finish_drains() == 0
    router("r1", generation=needed, inflight={})
    assert services.workers_finish_drains() == 1
    worker.refresh_from_db()
    assert worker.state == WorkerState.DRAINED
    assert services.worker_drain(worker_id=worker.pk, actor="ops").state == WorkerState.DRAINED
    assert kinds(worker)[-2:] == [EventKind.DRAIN_STARTED, EventKind.DRAIN_FINISHED]


def test_a_models_last_worker_is_drained_or_removed_only_when_forced() -> None:
    worker = agent_worker()
    router("r1", generation=0, inflight={str(worker.pk): 1})
    with pytest.raises(LastRoutableWorker, match=r"last routable worker of m \(1 request in"):
        services.worker_drain(worker_id=worker.pk, actor="ops", refuse_last=True)
    with pytest.raises(LastRoutableWorker, match="removing it"):
        services.worker_remove(worker_id=worker.pk, actor="ops", refuse_last=True)
    assert Worker.objects.get(pk=worker.pk).state == WorkerState.ACTIVE
    services.worker_remove(worker_id=worker.pk, actor="ops")
    left = Event.objects.get(kind=EventKind.WORKER_LEFT)
    assert left.worker is None and left.data["worker_id"] == worker.pk
    assert left.data["after"] == {"state": "removed"}


def test_activation_gives_an_agents_worker_a_fresh_heartbeat() -> None:
    worker = agent_worker()
    long_ago = timezone.now() - timedelta(days=1)
    Worker.objects.filter(pk=worker.pk).update(state=WorkerState.DRAINED, last_heartbeat=long_ago)
    active = services.worker_activate(worker_id=worker.pk, actor="ops")
    assert active.state == WorkerState.ACTIVE
    assert active.last_heartbeat is not None and active.last_heartbeat > long_ago
    event = Event.objects.filter(worker=worker).latest("pk")
    assert event.message == "activated (was drained)"


def test_an_update_logs_what_changed_and_never_the_key() -> None:
    worker = agent_worker(name="w")
    with pytest.raises(InvalidWeight):
        services.worker_update(worker_id=worker.pk, name=None, weight=-1, actor="ops")
    services.worker_update(
        worker_id=worker.pk, name="renamed", weight=2.0, api_key="sk-new", actor="ops"
    )
    updated = Worker.objects.get(pk=worker.pk)
    assert (updated.name, updated.weight, updated.api_key) == ("renamed", 2.0, "sk-new")
    key_event = Event.objects.get(kind=EventKind.WORKER_KEY_CHANGED)
    assert key_event.message == "upstream API key set"
    change = Event.objects.get(kind=EventKind.WORKER_CHANGED)
    assert change.data == {"before": {"name": "w", "weight": 1.0},
                           "after": {"name": "renamed", "weight": 2.0}}  # fmt: skip
    assert "sk-new" not in str(list(Event.objects.values_list("message", "data")))
    services.worker_update(worker_id=worker.pk, name=None, weight=None, actor="ops")
    assert Event.objects.filter(kind=EventKind.WORKER_CHANGED).count() == 1  # nothing changed
