"""The registry's enumerations: a worker's state, role and source, an event's kind and a
rollout plan's state, as stored in their models' fields (controlpanel.registry.models)."""

from __future__ import annotations

from django.db import models


class WorkerState(models.TextChoices):
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    UNHEALTHY = "unhealthy"
    OFFLINE = "offline"
    # Answers its probes but fails too much real traffic (controlpanel.fleet.traffic_health).
    DEGRADED = "degraded"


class WorkerRole(models.TextChoices):
    """Its part in prefill/decode disaggregation (routing.pd): a model with routable
    "prefill" workers is disaggregated, its prompts computed on one of them and its tokens
    generated on a "decode" or "both" worker; "both" serves whole requests, as before."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class WorkerSource(models.TextChoices):
    OPERATOR = "operator", "added by an operator"
    AGENT = "agent", "registered by an agent"


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
    WORKER_DEGRADED = "worker_degraded"  # too many of its real requests failed
    WORKER_RECOVERED = "worker_recovered"
    WORKER_SLEEPING = "worker_sleeping"
    WORKER_AWAKE = "worker_awake"
    POLICY_CHANGED = "policy_changed"
    WORKER_EJECTED = "worker_ejected"  # by a router, after failures on real traffic
    WORKER_READMITTED = "worker_readmitted"
    ALIAS_CHANGED = "alias_changed"
    ROLLOUT = "rollout"  # every transition of a rollout plan; data holds from/to states
    GPU_WARNING = "gpu_warning"
    GPU_CLEARED = "gpu_cleared"
    API_KEY_CREATED = "api_key_created"
    API_KEY_REVOKED = "api_key_revoked"
    API_KEY_CHANGED = "api_key_changed"  # limits, class, weight or budgets; data: before/after
    MODEL_CHANGED = "model_changed"  # a served model's settings (limit, reserve, fallbacks...)
    WORKER_CHANGED = "worker_changed"  # a worker's settings (name, weight, endpoints...)
    WORKER_KEY_CHANGED = "worker_key_changed"  # set, rotated or removed; never the key
    PREFLIGHT = "preflight"  # a worker's differences from its pool appeared, changed or ended


class RolloutState(models.TextChoices):
    SCHEDULED = "scheduled"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    ROLLING_BACK = "rolling_back", "rolling back"
    ROLLED_BACK = "rolled_back", "rolled back"
    ABORTED = "aborted"
