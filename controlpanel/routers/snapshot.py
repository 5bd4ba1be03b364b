"""The routers' port into the registry: the snapshot they route from, and their reports.

`DatabaseSnapshotSource` implements what routing.refresher needs, backed by the ORM; the
refresher calls it from its own thread, never on a request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime
from functools import cache, wraps
from types import MappingProxyType
from typing import Any, ParamSpec, TypeVar

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Field
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from controlpanel.fleet import gpu_health, preflight
from controlpanel.fleet.probes import worker_auth
from controlpanel.keys import services as keys
from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import RoutingGeneration, ServedModel, Worker
from controlpanel.rollouts.aliases import aliases_as_routes, aliases_fallbacks
from controlpanel.routers import reports
from routing.admission.usage import UsageBatch
from routing.fleet.snapshot import (
    GpuView,
    ModelEntry,
    ServedModelInfo,
    Snapshot,
    WorkerView,
    build_snapshot,
)
from routing.ports import RouterReport

P = ParamSpec("P")
T = TypeVar("T")


def worker_view(
    worker: Worker, *, now: datetime, preflight_modes: dict[str, str] | None = None
) -> WorkerView:
    degraded_weight = settings.CONTROLPANEL_DEGRADED_WEIGHT
    routable = worker.is_routable(settings.CONTROLPANEL_HEARTBEAT_EXPIRY, now, degraded_weight)
    metrics = worker.metrics or {}
    return WorkerView(
        id=worker.pk,
        name=worker.name,
        url=worker.url,
        state=worker.state,
        source=worker.source,
        models=tuple(_model_entry(m) for m in worker.models),
        queue_length=worker.queue_length,
        last_heartbeat=worker.last_heartbeat.timestamp() if worker.last_heartbeat else None,
        routable=routable,
        weight=worker.routing_weight(degraded_weight),
        running=metrics.get("running"),
        waiting=metrics.get("waiting"),
        kv_cache_usage=metrics.get("kv_cache_usage"),
        prefix_hit_rate=metrics.get("prefix_hit_rate"),
        metrics_age=(now - worker.last_probe_at).total_seconds() if worker.last_probe_at else None,
        metrics=MappingProxyType(dict(metrics)),
        gpus=_gpu_views(worker, now=now),
        upstream_authorization=worker_auth(worker.api_key).get("Authorization"),
        queue_at=worker.queue_length_at.timestamp() if worker.queue_length_at else None,
        refused_models=preflight.refused_models(worker, preflight_modes or {}),
        kv_events=worker.kv_events,
        kv_events_replay=worker.kv_events_replay,
        kv_block_size=_block_size(worker, metrics),
        role=worker.role,
    )


def _block_size(worker: Worker, metrics: dict[str, Any]) -> int | None:
    """vllm:cache_config_info's block_size: the last scrape's, else the one last seen."""
    cache = preflight.cache_labels(metrics) or (worker.pool_facts or {}).get("cache") or {}
    value = cache.get("block_size")
    try:
        size = int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return size if size is not None and size > 0 else None


_GPU_FIELDS = frozenset(f.name for f in fields(GpuView))


def _gpu_views(worker: Worker, *, now: datetime) -> tuple[GpuView, ...]:
    # Known keys only: a stored reading must never break the router's snapshot.
    readings = gpu_health.fresh_gpus(worker, now) or []
    known = [{k: v for k, v in g.items() if k in _GPU_FIELDS} for g in readings]
    return tuple(GpuView(**g) for g in known if "index" in g)


def _model_entry(raw: dict[str, Any]) -> ModelEntry:
    return ModelEntry(
        id=raw["id"],
        parent=raw.get("parent"),
        root=raw.get("root"),
        max_model_len=raw.get("max_model_len"),
        created=raw.get("created"),
    )


def routing_snapshot_build() -> Snapshot:
    generation = RoutingGeneration.current()
    now = timezone.now()
    rows = list(Worker.objects.all())
    models = list(ServedModel.objects.all())
    modes = {m.name: m.preflight for m in models}
    workers = [worker_view(w, now=now, preflight_modes=modes) for w in rows]
    served = [
        ServedModelInfo(
            name=m.name,
            policy=m.policy,
            policy_config=m.policy_config,
            max_inflight=m.max_inflight,
            tokenizer=m.tokenizer,
            priority_reserve=m.priority_reserve,
            fallbacks=tuple(m.fallbacks),
            pd_bypass_tokens=m.pd_bypass_tokens,
        )
        for m in models
    ]
    return build_snapshot(
        workers=workers,
        served_models=served,
        aliases=aliases_as_routes(),
        alias_fallbacks=aliases_fallbacks(),
        api_keys=keys.client_keys(),
        generation=generation,
        deployment=RoutingGeneration.deployment_id(),
        now=now.timestamp(),
        valid_until=min(_first_heartbeat_deadline(workers), _first_gpu_deadline(rows, now)),
    )


def load_reports() -> dict[int, tuple[int, float]]:
    """Each worker's last reported queue (running + waiting) and when it was read: every
    router asks once a second, idle or not. One plain query, as RoutingGeneration.current:
    through the ORM it cost eight times as much (254 against 33 µs on SQLite; #29)."""
    with connection.cursor() as cursor:
        cursor.execute(_load_reports_sql())
        rows = cursor.fetchall()
    return {pk: (queue or 0, _timestamp(at)) for pk, queue, at in rows if at is not None}


@cache  # one database per process: its quoting does not change
def _load_reports_sql() -> str:
    pk, queue, at = (_column(name) for name in ("id", "queue_length", "queue_length_at"))
    table = connection.ops.quote_name(Worker._meta.db_table)
    return f"SELECT {pk}, {queue}, {at} FROM {table} WHERE {at} IS NOT NULL"


def _column(name: str) -> str:
    field = Worker._meta.get_field(name)
    assert isinstance(field, Field)  # a column of the table, not a relation's other side
    return connection.ops.quote_name(field.column)


def _timestamp(at: datetime | str) -> float:
    """A DateTimeField's value as the raw query returns it: an aware datetime from
    PostgreSQL, UTC text from SQLite (USE_TZ)."""
    moment = at if isinstance(at, datetime) else parse_datetime(at)
    if moment is None:
        raise ValueError(f"not a timestamp: {at!r}")
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _first_heartbeat_deadline(workers: list[WorkerView]) -> float:
    expiry = settings.CONTROLPANEL_HEARTBEAT_EXPIRY
    deadlines = [
        w.last_heartbeat + expiry
        for w in workers
        if w.routable and w.source == WorkerSource.AGENT and w.last_heartbeat is not None
    ]
    return min(deadlines, default=float("inf"))


def _first_gpu_deadline(workers: list[Worker], now: datetime) -> float:
    """When the first fresh GPU readings turn stale, so /metrics stops exporting them then
    even if nothing is written (the agent and Celery both gone)."""
    stale_after = gpu_health.stale_after()
    deadlines = [
        w.gpus_at.timestamp() + stale_after for w in workers if w.gpus_source and w.gpus_at
    ]
    return min((d for d in deadlines if d > now.timestamp()), default=float("inf"))


def _fresh_connection(func: Callable[P, T]) -> Callable[P, T]:
    """The refresher's thread lives as long as the router: drop a connection the database
    closed (restart, idle timeout) so the next call reconnects by itself."""

    @wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        close_old_connections()
        try:
            return func(*args, **kwargs)
        except DatabaseError:
            connection.close()
            raise

    return wrapper


class DatabaseSnapshotSource:
    """What routing.refresher needs from the control plane, backed by the ORM."""

    @_fresh_connection
    def generation(self) -> int:
        return RoutingGeneration.current()

    @_fresh_connection
    def load(self) -> Snapshot:
        return routing_snapshot_build()

    @_fresh_connection
    def report(self, report: RouterReport) -> bool:
        return reports.router_report(report=report)

    @_fresh_connection
    def load_reports(self) -> dict[int, tuple[int, float]]:
        return load_reports()

    @_fresh_connection
    def record_usage(self, *, usage: UsageBatch) -> None:
        keys.usage_record(usage=usage)

    @_fresh_connection
    def forget(self, *, instance_id: str) -> None:
        reports.router_forget(instance_id=instance_id)
