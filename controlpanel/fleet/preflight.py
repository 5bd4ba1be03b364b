"""Pool preflight: is this worker like the rest of its model's pool?

Workers that serve one model name should be interchangeable: a router sends any request to
any of them. One that runs another vLLM version, another context length, another KV-cache
block size or dtype, or lacks a LoRA adapter the others have, answers differently, caches
differently (prefix routing assumes one block size), or fails some requests. So whenever a
worker joins a pool or its models change (and on every probe round, which also catches a
restart into another version), its facts are compared with the pool's, field by field:

* ``version``: vLLM's ``GET /version`` (read again when the worker's model list changes);
* ``max_model_len`` and ``root``: from its ``/v1/models`` entry for the model;
* ``block_size``, ``cache_dtype``, ``enable_prefix_caching``, ``sliding_window``: the labels
  of ``vllm:cache_config_info`` in its last scraped ``/metrics``;
* ``loras``: the LoRA adapters it lists for the model.

The pool's value of a field is the one most of the *other* workers of the pool report. A
field the worker or the whole rest of the pool does not report is unknown, never a
mismatch; a pool of one has nothing to differ from.

A mismatch is shown on the worker and models pages ("block_size 16 vs pool 32"), in
``GET /api/workers/{id}``, and in the event log when it appears, changes or ends. A model
set to ``preflight: "refuse"`` (``PATCH /api/models/{name}``, the models page) also keeps the
mismatched worker out of that model's rotation (routing.fleet.snapshot: ``refused_models``) until it
matches again, or an operator accepts exactly those differences
(``POST /api/workers/{id}/preflight/accept``, the worker page). "warn" (the default) only shows.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlpanel.fleet.discovery import model_keys
from controlpanel.fleet.probes import tls_context, worker_auth
from controlpanel.registry.choices import EventKind
from controlpanel.registry.events import event_record
from controlpanel.registry.models import RoutingGeneration, ServedModel, Worker
from routing.telemetry.vllm_metrics import SERIES_KEY

log = logging.getLogger(__name__)

CACHE_FIELDS = ("block_size", "cache_dtype", "enable_prefix_caching", "sliding_window")
FIELDS = ("version", "max_model_len", "root", *CACHE_FIELDS, "loras")
CACHE_INFO = "vllm:cache_config_info"


# -- what a worker says of itself ---------------------------------------------------------


def cache_labels(metrics: dict[str, Any]) -> dict[str, str]:
    """vllm:cache_config_info's labels from the worker's last scrape (empty: unknown)."""
    family: Any = (metrics.get(SERIES_KEY) or {}).get(CACHE_INFO)
    try:
        samples = family[2]
        labels: dict[str, str] = dict(samples[0][1]) if samples else {}
    except (TypeError, IndexError, KeyError, ValueError):
        return {}
    return {k: str(v) for k, v in labels.items() if k in CACHE_FIELDS}


def version_read(worker: Worker) -> str | None:
    """GET /version, or None when the server does not say (never a guess)."""
    import httpx  # here: the router process imports this module, and rarely reads /version

    try:
        response = httpx.get(
            f"{worker.url}/version",
            headers=worker_auth(worker.api_key),
            timeout=settings.CONTROLPANEL_PROBE_TIMEOUT,
            verify=tls_context(),
        )
        value = response.json().get("version") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def facts_refresh(worker: Worker) -> dict[str, Any]:
    """The worker's facts, reading /version again only when its model list changed (a new
    registration, a restart) or was never read."""
    facts = dict(worker.pool_facts or {})
    key = repr(model_keys(worker.models))
    if facts.get("models_key") != key or "version" not in facts:
        facts["version"] = version_read(worker)
        facts["models_key"] = key
    facts["cache"] = cache_labels(worker.metrics or {}) or facts.get("cache") or {}
    return facts


def model_facts(worker: Worker, facts: dict[str, Any], model: str) -> dict[str, Any]:
    """Every field's value for one model this worker serves (None: unknown)."""
    entry: dict[str, Any] = next((m for m in worker.models if m.get("id") == model), {})
    cache = facts.get("cache") or {}
    loras = sorted(m["id"] for m in worker.models if m.get("parent") == model)
    return {
        "version": facts.get("version"),
        "max_model_len": entry.get("max_model_len"),
        "root": entry.get("root"),
        **{name: cache.get(name) for name in CACHE_FIELDS},
        "loras": ",".join(loras),  # always known: /v1/models lists every adapter loaded
    }


# -- comparing with the pool --------------------------------------------------------------


def mismatches(mine: dict[str, Any], others: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fields where this worker's known value differs from what most of the others report."""
    others = list(others)
    found = []
    for field in FIELDS:
        value = mine.get(field)
        votes = Counter(o[field] for o in others if o.get(field) is not None)
        if value is None or not votes:
            continue  # unknown on one side: never a mismatch
        pool = votes.most_common(1)[0][0]
        if value != pool:
            found.append({"field": field, "value": value, "pool": pool})
    return found


def describe(mismatch: dict[str, Any]) -> str:
    """As the pages show it: "block_size 16 vs pool 32"."""
    return f"{mismatch['field']} {mismatch['value']} vs pool {mismatch['pool']}"


def accept_key(model: str, mismatch: dict[str, Any]) -> str:
    return f"{model}|{mismatch['field']}|{mismatch['value']}"


def unaccepted(worker: Worker) -> dict[str, list[dict[str, Any]]]:
    """The worker's mismatches per model that no operator accepted."""
    accepted = set(worker.preflight_accepted or [])
    found = (worker.preflight or {}).get("mismatches", {})
    out = {m: [x for x in xs if accept_key(m, x) not in accepted] for m, xs in found.items()}
    return {m: xs for m, xs in out.items() if xs}


def refused_models(worker: Worker, modes: dict[str, str]) -> frozenset[str]:
    """The models whose pool the worker is kept out of ("refuse" with unaccepted mismatches)."""
    return frozenset(m for m in unaccepted(worker) if modes.get(m) == "refuse")


# -- the services ---------------------------------------------------------------------------


def pools_preflight(*, actor: str = "preflight") -> int:
    """Check every worker against its pools; returns how many workers' results changed."""
    workers = list(Worker.objects.all())
    facts = {w.pk: facts_refresh(w) for w in workers}
    serving: dict[str, list[Worker]] = {}
    for worker in workers:
        for entry in worker.models:
            if not entry.get("parent"):  # pools are base models; adapters are a field
                serving.setdefault(entry["id"], []).append(worker)
    changed = 0
    for worker in workers:
        found = {}
        for model, pool in serving.items():
            if worker not in pool:
                continue
            mine = model_facts(worker, facts[worker.pk], model)
            others = [model_facts(o, facts[o.pk], model) for o in pool if o.pk != worker.pk]
            if differ := mismatches(mine, others):
                found[model] = differ
        changed += _record(worker, facts[worker.pk], found, actor)
    return changed


def _record(
    worker: Worker, facts: dict[str, Any], found: dict[str, list[dict[str, Any]]], actor: str
) -> int:
    before = (worker.preflight or {}).get("mismatches", {})
    fields = {"pool_facts": facts}
    if found != before:
        fields["preflight"] = {"mismatches": found, "checked_at": timezone.now().isoformat()}
    if facts == worker.pool_facts and "preflight" not in fields:
        return 0
    with transaction.atomic():
        Worker.objects.filter(pk=worker.pk).update(**fields)
        if "preflight" in fields:
            event_record(
                kind=EventKind.PREFLIGHT,
                worker=worker,
                message=_summary(found) if found else "matches its pools again",
                actor=actor,
                data={"mismatches": found},
            )
            RoutingGeneration.bump()  # a "refuse" model's rotation may change
    return int("preflight" in fields)


def _summary(found: dict[str, list[dict[str, Any]]]) -> str:
    return "; ".join(f"{model}: {', '.join(map(describe, xs))}" for model, xs in found.items())


def worker_preflight_accept(*, worker_id: int, actor: str) -> Worker:
    """Accept the worker's current differences: a "refuse" pool takes it back, and only a
    new difference (another field, another value) refuses it again."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        found = (worker.preflight or {}).get("mismatches", {})
        keys = sorted({accept_key(m, x) for m, xs in found.items() for x in xs})
        worker.preflight_accepted = keys
        worker.save(update_fields=["preflight_accepted", "updated_at"])
        event_record(
            kind=EventKind.PREFLIGHT,
            worker=worker,
            message=f"differences accepted: {_summary(found) or 'none'}",
            actor=actor,
            data={"accepted": keys},
        )
        RoutingGeneration.bump()
    return worker


def preflight_modes() -> dict[str, str]:
    return dict(ServedModel.objects.values_list("name", "preflight"))
