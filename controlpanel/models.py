"""The registry: workers, the model names they serve, the event log and router liveness."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.db import models, transaction
from django.db.models import F, JSONField
from django.utils import timezone


def normalize_worker_url(url: str) -> str:
    """One spelling per server, so `HTTP://Host:8000/v1/` and `http://host:8000` are the
    same worker: lower-case scheme and host, no trailing slash, no `/v1` suffix."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"a worker URL has no query or fragment: {url!r}")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme.lower(), netloc, path, "", ""))


class WorkerState(models.TextChoices):
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    UNHEALTHY = "unhealthy"
    OFFLINE = "offline"


class WorkerSource(models.TextChoices):
    OPERATOR = "operator", "added by an operator"
    AGENT = "agent", "registered by an agent"


class Worker(models.Model):
    url = models.CharField(max_length=512, unique=True)
    name = models.CharField(max_length=200)
    state = models.CharField(
        max_length=16, choices=WorkerState.choices, default=WorkerState.ACTIVE, db_index=True
    )
    source = models.CharField(max_length=16, choices=WorkerSource.choices)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    queue_length = models.PositiveIntegerField(null=True, blank=True)
    # Relative share for weighted policies (`random`); 0 takes a worker out of their draw.
    weight = models.FloatField(default=1.0)
    # The routing generation that announced the drain: a router that has not yet reported
    # from a snapshot at least this new may still pick the worker, so the drain waits for it.
    drain_generation = models.BigIntegerField(null=True, blank=True)
    # Health, from Celery probes and from the routers' passive failure reports.
    consecutive_failures = models.PositiveIntegerField(default=0)
    consecutive_successes = models.PositiveIntegerField(default=0)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    sleeping = models.BooleanField(null=True, blank=True)  # vllm:engine_sleep_state; None: unknown
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # As vLLM lists them in /v1/models: [{"id", "parent", "root", "max_model_len"}]; a LoRA
    # adapter is an entry whose parent is the base model's id. (Last, because the name
    # shadows the `models` module inside this class body.)
    models = JSONField(default=list, blank=True)
    # The latest scraped signals, each None when the worker does not export it (never a
    # made-up zero): running, waiting, kv_cache_usage, prefix_hit_rate, ttft_p50, ttft_p95,
    # rps. `scrape_state` keeps the raw counters the next probe needs for its deltas.
    metrics = JSONField(default=dict, blank=True)
    scrape_state = JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["name", "id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.url})"

    @property
    def model_ids(self) -> list[str]:
        return [m["id"] for m in self.models]

    def heartbeat_age(self, now: datetime | None = None) -> float | None:
        if self.last_heartbeat is None:
            return None
        return ((now or timezone.now()) - self.last_heartbeat).total_seconds()

    def heartbeat_expired(self, expiry_seconds: int, now: datetime | None = None) -> bool:
        """Only agents promise heartbeats; an operator-added worker is judged by probes."""
        if self.source != WorkerSource.AGENT:
            return False
        age = self.heartbeat_age(now)
        return age is None or age > expiry_seconds

    def is_routable(self, expiry_seconds: int, now: datetime | None = None) -> bool:
        """The one rule for "gets new requests", shared by the router's snapshot and the
        dashboard so the two never disagree."""
        return (
            self.state == WorkerState.ACTIVE
            and not self.sleeping
            and not self.heartbeat_expired(expiry_seconds, now)
        )


class ServedModel(models.Model):
    """A model name clients can ask for, and how requests for it are balanced."""

    name = models.CharField(max_length=300, unique=True)
    policy = models.CharField(max_length=64, default="shortest_queue")
    policy_config = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class RoutingGeneration(models.Model):
    """One row whose counter moves on every change the router must see.

    Routers poll this single integer (cheap on SQLite and PostgreSQL alike) and rebuild
    their snapshot only when it moved, so a change in any process reaches them in well
    under a second without a message bus.
    """

    generation = models.BigIntegerField(default=0)

    @classmethod
    def bump(cls) -> None:
        from controlpanel.live import nudge_dashboards  # live imports the models

        transaction.on_commit(nudge_dashboards)
        if not cls.objects.filter(pk=1).update(generation=F("generation") + 1):
            # A fresh row (new database, restored backup, flushed tables) starts at a random
            # point, so a router can never mistake the new count for the one it last saw.
            start = secrets.randbits(48)
            cls.objects.get_or_create(pk=1, defaults={"generation": start})

    @classmethod
    def current(cls) -> int:
        return cls.objects.filter(pk=1).values_list("generation", flat=True).first() or 0


class RouterInstance(models.Model):
    """A running router process and what it has in flight, so a drain can tell when the
    last request on a worker finished in *every* router, not only in one."""

    instance_id = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_index=True)
    inflight = models.JSONField(default=dict, blank=True)
    # The snapshot generation the router was routing with when it counted `inflight`.
    generation = models.BigIntegerField(default=-1)
    # Requests and failures per worker over the router's last minute: {id: [requests, errors]}.
    recent = models.JSONField(default=dict, blank=True)

    @classmethod
    def live(cls, within: timedelta) -> models.QuerySet[RouterInstance]:
        return cls.objects.filter(last_seen__gte=timezone.now() - within)


class WorkerSample(models.Model):
    """One probe's reading, kept for the dashboard's charts and pruned after a while."""

    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    up = models.BooleanField()
    running = models.IntegerField(null=True)
    waiting = models.IntegerField(null=True)
    kv_cache_usage = models.FloatField(null=True)
    prefix_hit_rate = models.FloatField(null=True)
    ttft_p50 = models.FloatField(null=True)
    rps = models.FloatField(null=True)

    class Meta:
        ordering = ["at"]
        indexes = [models.Index(fields=["worker", "at"])]


class EventKind(models.TextChoices):
    WORKER_JOINED = "worker_joined"
    WORKER_LEFT = "worker_left"
    WORKER_OFFLINE = "worker_offline"
    WORKER_BACK = "worker_back"
    DRAIN_STARTED = "drain_started"
    DRAIN_FINISHED = "drain_finished"
    WORKER_ACTIVATED = "worker_activated"
    MODELS_CHANGED = "models_changed"
    WORKER_UNHEALTHY = "worker_unhealthy"
    WORKER_RECOVERED = "worker_recovered"
    WORKER_SLEEPING = "worker_sleeping"
    WORKER_AWAKE = "worker_awake"
    POLICY_CHANGED = "policy_changed"


class Event(models.Model):
    """The audit trail of state changes: what happened, to which worker, and why."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=32, choices=EventKind.choices)
    worker = models.ForeignKey(Worker, null=True, blank=True, on_delete=models.SET_NULL)
    subject = models.CharField(max_length=512, blank=True)
    message = models.TextField(blank=True)
    actor = models.CharField(max_length=200, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind} {self.subject}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.pk,
            "at": self.created_at.isoformat(),
            "kind": self.kind,
            "worker_id": self.worker_id,
            "subject": self.subject,
            "message": self.message,
            "actor": self.actor,
        }
