"""The registry: workers, the model names they serve, the event log and router liveness."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.db import connection, models, transaction
from django.db.models import F, JSONField
from django.utils import timezone

from controlpanel.registry.choices import (
    EventKind,
    RolloutState,
    WorkerRole,
    WorkerSource,
    WorkerState,
)
from controlpanel.registry.sealed import SealedCharField
from controlpanel.registry.signals import announce_routing_committed
from routing.fleet.priority import PRIORITIES


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


def new_deployment_id() -> str:
    return secrets.token_hex(16)


class Worker(models.Model):
    url = models.CharField(max_length=512, unique=True)
    name = models.CharField(max_length=200)
    state = models.CharField(
        max_length=16, choices=WorkerState.choices, default=WorkerState.ACTIVE, db_index=True
    )
    source = models.CharField(max_length=16, choices=WorkerSource.choices)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    queue_length = models.PositiveIntegerField(null=True, blank=True)
    # When queue_length was read (a probe's /metrics, or an agent's heartbeat): the routers
    # correct it by what they sent since (routing.policies.load), and ignore it once stale.
    queue_length_at = models.DateTimeField(null=True, blank=True)
    # Relative share for weighted policies (`random`); 0 takes a worker out of their draw.
    weight = models.FloatField(default=1.0)
    # vLLM's KV cache events publisher (`--kv-events-config`), e.g. "tcp://host:5557", and
    # its optional replay endpoint: every router subscribes (routing.kv.kv_events). "": none.
    kv_events = models.CharField(max_length=512, blank=True, default="")
    kv_events_replay = models.CharField(max_length=512, blank=True, default="")
    role = models.CharField(max_length=8, choices=WorkerRole.choices, default=WorkerRole.BOTH)
    # The routing generation that announced the drain: a router that has not yet reported
    # from a snapshot at least this new may still pick the worker, so the drain waits for it.
    drain_generation = models.BigIntegerField(null=True, blank=True)
    # Health, from Celery probes and from the routers' passive failure reports.
    consecutive_failures = models.PositiveIntegerField(default=0)
    consecutive_successes = models.PositiveIntegerField(default=0)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    # Why real traffic put the worker in `degraded` (its error rate over the window), kept
    # apart from last_error, which every good probe clears.
    degraded_reason = models.TextField(blank=True)
    sleeping = models.BooleanField(null=True, blank=True)  # vllm:engine_sleep_state; None: unknown
    # GPU telemetry (controlpanel.gpu): the latest per-GPU readings from the agent's NVML or
    # from the DCGM exporter at `dcgm_url`, in one shape whichever source sent them; an
    # empty list with no source means nothing reports, which the dashboard calls "unknown".
    dcgm_url = models.CharField(max_length=512, blank=True)
    # The key the vLLM server was started with (--api-key / VLLM_API_KEY): the router, the
    # probes and LoRA calls send it as Authorization: Bearer. Never shown after it is set,
    # and sealed in the database (controlpanel.sealed).
    api_key = SealedCharField(blank=True)
    gpus = JSONField(default=list, blank=True)
    gpus_source = models.CharField(max_length=8, blank=True)  # "nvml", "dcgm" or ""
    gpus_at = models.DateTimeField(null=True, blank=True)
    # The most GPUs this worker has reported: fewer later means one fell off the bus.
    gpu_count_max = models.PositiveSmallIntegerField(null=True, blank=True)
    gpu_warnings = JSONField(default=list, blank=True)  # in force now: [{"key", "message"}]
    # Pool preflight (controlpanel.fleet.preflight): what the worker says of itself beyond
    # /v1/models ({"version", "cache": vllm:cache_config_info's labels, "models_key"}), how it
    # differs from the rest of each of its models' pools ({"mismatches": {model: [{"field",
    # "value", "pool"}]}, "checked_at"}), and the differences an operator accepted.
    pool_facts = JSONField(default=dict, blank=True)
    preflight = JSONField(default=dict, blank=True)
    preflight_accepted = JSONField(default=list, blank=True)  # ["model|field|value", ...]
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

    def is_routable(
        self, expiry_seconds: int, now: datetime | None = None, degraded_weight: float = 0.0
    ) -> bool:
        """The one rule for "gets new requests", shared by the router's snapshot and the
        dashboard so the two never disagree. A degraded worker stays in only when degraded
        workers keep a reduced weight (CONTROLPANEL_DEGRADED_WEIGHT > 0)."""
        in_rotation = self.state == WorkerState.ACTIVE or (
            self.state == WorkerState.DEGRADED and degraded_weight > 0
        )
        return in_rotation and not self.sleeping and not self.heartbeat_expired(expiry_seconds, now)

    def routing_weight(self, degraded_weight: float = 0.0) -> float:
        if self.state == WorkerState.DEGRADED:
            return self.weight * degraded_weight
        return self.weight


class ServedModel(models.Model):
    """A model name clients can ask for, and how requests for it are balanced."""

    name = models.CharField(max_length=300, unique=True)
    policy = models.CharField(max_length=64, default="shortest_queue")
    policy_config = models.JSONField(default=dict, blank=True)
    # Requests in flight for this model per router process (routing.admission.admission); 0: no
    # limit.
    max_inflight = models.PositiveIntegerField(default=0)
    # A local folder with a Hugging Face tokenizer.json and tokenizer_config.json: kv_aware
    # tokenizes requests with it as vLLM would. "": ask a worker's POST /tokenize instead.
    tokenizer = models.CharField(max_length=1024, blank=True, default="")
    # A worker that differs from the rest of this model's pool (controlpanel.fleet.preflight)
    # is shown as such ("warn"), or also kept out of the model's rotation until it matches or
    # an operator accepts it ("refuse").
    preflight = models.CharField(
        max_length=8, choices=[("warn", "warn"), ("refuse", "refuse")], default="warn"
    )
    # The share of the admission slots `sheddable` requests may never hold, kept for the
    # higher classes (routing.fleet.priority); only matters under an in-flight limit.
    priority_reserve = models.FloatField(default=0.2)
    # Ordered model or alias names a request moves on to when this model has no routable
    # worker or failed before its first byte (routing.fleet.fallbacks).
    fallbacks = models.JSONField(default=list, blank=True)
    # Disaggregated (it has prefill workers): a request whose uncached prompt is shorter
    # than this many tokens skips the prefill leg and goes whole to a decode-capable worker.
    pd_bypass_tokens = models.PositiveIntegerField(default=256)
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
    # This deployment's identity, made once with the row: every router of the deployment
    # shares routing state under it in Redis, and a database of another deployment (a test
    # run, a staging copy) sharing the same Redis never mixes with it.
    deployment = models.CharField(max_length=32, default=new_deployment_id)

    @classmethod
    def bump(cls) -> None:
        transaction.on_commit(announce_routing_committed)
        if not cls.objects.filter(pk=1).update(generation=F("generation") + 1):
            # A fresh row (new database, restored backup, flushed tables) starts at a random
            # point, so a router can never mistake the new count for the one it last saw.
            start = secrets.randbits(48)
            cls.objects.get_or_create(pk=1, defaults={"generation": start})

    @classmethod
    def current(cls) -> int:
        """The counter, by one plain query: every router runs this a few times a second
        (CONTROLPANEL_SNAPSHOT_POLL), and the ORM's compiling of the same query cost some
        twenty times the query itself, most of an idle router's CPU."""
        table = connection.ops.quote_name(cls._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT generation FROM {table} WHERE id = 1")
            row = cursor.fetchone()
        return int(row[0]) if row and row[0] else 0

    @classmethod
    def deployment_id(cls) -> str:
        """The deployment's identity; "" until the first change makes the row (readers such
        as the routers' snapshot source never write)."""
        return cls.objects.filter(pk=1).values_list("deployment", flat=True).first() or ""


# A router that has not reported for this long is presumed gone: its in-flight counts no
# longer hold a drain open, and its traffic no longer counts in rollout gates.
ROUTER_LIVENESS = timedelta(seconds=15)


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
    # Per model since the router started: {"requests", "errors", "ttft": [bucket counts]}
    # (routing.telemetry.metrics.RouterMetrics.model_totals), which rollout gates difference.
    traffic = models.JSONField(default=dict, blank=True)
    # Per worker over the control plane's own windows (controlpanel.fleet.traffic_health):
    # {id: [requests, errors over CONTROLPANEL_DEGRADED_WINDOW, requests over the rate window]}
    window = models.JSONField(default=dict, blank=True)
    # Each subscribed worker's KV events stream as this router sees it (routing.kv.kv_subscriber):
    # {id: {"connected", "events_per_s", "last_seq", "gaps", "trust", "blocks", ...}}.
    kv_events = models.JSONField(default=dict, blank=True)
    # Per model under the in-flight limits (routing.admission.admission.class_counts): {"queued",
    # "admitted", "shed": [critical, standard, sheddable]}, counts since the router started.
    classes = models.JSONField(default=dict, blank=True)
    # Requests moved on to a fallback since the router started (routing.fleet.fallbacks):
    # [[from, to, reason, count], ...].
    fallbacks = models.JSONField(default=list, blank=True)

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
    gpus = models.JSONField(null=True)  # per-GPU chart points: [{"index", "util", "mem", ...}]

    class Meta:
        ordering = ["at"]
        indexes = [models.Index(fields=["worker", "at"])]


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


class Alias(models.Model):
    """A public model name that clients use, standing for weighted target model names."""

    name = models.CharField(max_length=300, unique=True)
    # {target model name: integer weight >= 0}; the router draws targets by weight.
    targets = models.JSONField(default=dict)
    description = models.CharField(max_length=500, blank=True)
    # Ordered model or alias names to move on to, as a served model's (routing.fleet.fallbacks).
    fallbacks = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


ACTIVE_ROLLOUT_STATES = (RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.ROLLING_BACK)


class RolloutPlan(models.Model):
    """A persisted, step-by-step shift of an alias's traffic from one target to another.

    Every change of state goes through controlpanel.rollouts.transitions, which claims it with a
    conditional UPDATE on (`state`, `version`), so two Celery workers never both act."""

    alias = models.ForeignKey(Alias, on_delete=models.PROTECT, related_name="rollouts")
    from_target = models.CharField(max_length=300)
    to_target = models.CharField(max_length=300)
    steps = models.JSONField()  # [{"weight": 5, "hold_seconds": 600}, ...], last weight 100
    start_at = models.DateTimeField(null=True, blank=True)  # None: as soon as created
    # Gates, checked while a step holds, over the step's own window of router metrics.
    max_error_rate = models.FloatField(default=0.02)
    max_ttft_p95_ratio = models.FloatField(default=1.5)
    min_requests = models.PositiveIntegerField(default=50)
    drain_old = models.BooleanField(default=False)
    state = models.CharField(
        max_length=16, choices=RolloutState.choices, default=RolloutState.SCHEDULED, db_index=True
    )
    version = models.PositiveIntegerField(default=0)  # bumped by every claimed transition
    step_index = models.IntegerField(default=-1)  # -1: not started
    step_started_at = models.DateTimeField(null=True, blank=True)
    paused_remaining = models.FloatField(null=True, blank=True)  # hold seconds left at pause
    # The routing generation that carried the step's weights, and each router's traffic
    # totals from its first report routing with them: {instance id: {model: totals}}. The
    # step's window counts only what came after, router by router.
    step_generation = models.BigIntegerField(null=True, blank=True)
    step_baseline = models.JSONField(default=dict, blank=True)
    # The alias's weights before the plan, which a rollback restores.
    original_targets = models.JSONField(default=dict, blank=True)
    # The old target's last measured p95 TTFT, for gates once it gets no traffic (100%).
    reference_ttft_p95 = models.FloatField(null=True, blank=True)
    # One entry per finished step: weights, observed requests, errors and p95 per target.
    history = models.JSONField(default=list, blank=True)
    last_check = models.JSONField(default=dict, blank=True)  # the latest gate evaluation
    reason = models.TextField(blank=True)  # why the plan is where it is, in words
    rollback_generation = models.BigIntegerField(null=True, blank=True)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"rollout #{self.pk} {self.alias.name}: {self.from_target} -> {self.to_target}"

    @property
    def current_step(self) -> dict[str, Any] | None:
        if 0 <= self.step_index < len(self.steps):
            step: dict[str, Any] = self.steps[self.step_index]
            return step
        return None

    def hold_left(self, now: datetime | None = None) -> float | None:
        """Seconds left in the current step's hold (None when no step is holding)."""
        if self.state == RolloutState.PAUSED:
            return self.paused_remaining
        step = self.current_step
        if self.state != RolloutState.RUNNING or step is None or self.step_started_at is None:
            return None
        elapsed = ((now or timezone.now()) - self.step_started_at).total_seconds()
        return max(0.0, float(step["hold_seconds"]) - elapsed)


PRIORITY_CHOICES = [(name, name) for name in PRIORITIES]


class ApiKey(models.Model):
    """A client's key for the router (routing.admission.auth). The key itself is shown once, at
    creation; only its SHA-256 is kept, and `prefix`, its public start, names it to people."""

    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)  # hex SHA-256 of the whole key
    # Model or alias names this key may use, as the client names them; empty: every model.
    allowed_models = models.JSONField(default=list, blank=True)
    rpm = models.PositiveIntegerField(null=True, blank=True)  # requests per minute
    tpm = models.PositiveIntegerField(null=True, blank=True)  # tokens per minute
    # May ask the router why a request went where it went (X-Route-Explain,
    # routing.telemetry.explain).
    can_explain = models.BooleanField(default=False)
    # Its requests' class under saturation (routing.fleet.priority): critical, standard,
    # sheddable.
    priority = models.CharField(max_length=16, choices=PRIORITY_CHOICES, default="standard")
    # Its share of the admitted capacity against other keys of its class (fair share).
    weight = models.FloatField(default=1.0)
    # Prompt + completion tokens per UTC day and per UTC month (routing.admission.budgets); None:
    # none.
    daily_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    monthly_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Revoked keys stay, so their usage keeps its name; the router no longer knows them.
    revoked_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


class KeyUsage(models.Model):
    """Requests and tokens of one key on one model (or alias) in one UTC day, as the
    routers counted them from the workers' `usage`."""

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=300)
    day = models.DateField()
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-day", "api_key", "model"]
        constraints = [
            models.UniqueConstraint(fields=["api_key", "model", "day"], name="one_usage_row")
        ]
