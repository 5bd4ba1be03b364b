"""Client API keys and their usage: create, revoke, the routers' view of the live keys, and
the usage the routers report (services and selectors, shared by the API, the dashboard and
the `create_api_key` command)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import date
from typing import Any

from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from controlpanel.registry.choices import EventKind
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.events import event_record
from controlpanel.registry.models import (
    Alias,
    ApiKey,
    KeyUsage,
    RoutingGeneration,
    ServedModel,
    Worker,
)
from routing.admission.auth import PREFIX_LENGTH, new_key
from routing.admission.usage import UsageBatch
from routing.fleet.client_keys import ClientKey
from routing.fleet.priority import PRIORITIES, STANDARD

MAX_NAME = 200
MAX_MODEL_NAME = 300
MAX_WEIGHT = 1000.0


class InvalidKeyRequest(ServiceError):
    status = 422


class KeyNotFound(ServiceError):
    status = 404


@dataclass(frozen=True)
class IssuedKey:
    """A key just made: `secret` is the only copy there will ever be of it."""

    record: ApiKey
    secret: str


# What an admin may change on a key (api_key_update), as the row's field names.
KEY_SETTINGS = (
    "name", "allowed_models", "rpm", "tpm", "can_explain",
    "priority", "weight", "daily_tokens", "monthly_tokens",
)  # fmt: skip


def api_key_create(
    *,
    name: str,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    actor: str,
    allow_unknown_models: bool = False,
    can_explain: bool = False,
    priority: str = STANDARD,
    weight: float = 1.0,
    daily_tokens: int | None = None,
    monthly_tokens: int | None = None,
) -> IssuedKey:
    """`allow_unknown_models`: keep model names nothing serves now (a model about to be
    added); without it a misspelt name is refused, since the key would silently get 404s."""
    settings = _checked_settings(
        {"name": name, "allowed_models": models or [], "rpm": rpm, "tpm": tpm,
         "can_explain": can_explain, "priority": priority, "weight": weight,
         "daily_tokens": daily_tokens, "monthly_tokens": monthly_tokens},
        allow_unknown_models=allow_unknown_models,
    )  # fmt: skip
    secret = new_key()
    with transaction.atomic():
        record = ApiKey.objects.create(
            prefix=secret[:PREFIX_LENGTH],
            key_hash=hashlib.sha256(secret.encode()).hexdigest(),
            created_by=actor,
            **settings,
        )
        RoutingGeneration.bump()  # routers learn the key with their next snapshot
        _key_event(EventKind.API_KEY_CREATED, record, actor, "created")
    return IssuedKey(record=record, secret=secret)


def api_key_update(
    *, key_id: int, actor: str, allow_unknown_models: bool = False, **changes: Any
) -> ApiKey:
    """Change some of a live key's KEY_SETTINGS; every router has them with its next
    snapshot. The event log gets what changed, before and after."""
    unknown = set(changes) - set(KEY_SETTINGS)
    if unknown:
        raise InvalidKeyRequest(f"a key has no setting {', '.join(sorted(unknown))}")
    with transaction.atomic():
        record = ApiKey.objects.select_for_update().filter(pk=key_id).first()
        if record is None:
            raise KeyNotFound(f"no API key {key_id}")
        if record.revoked_at is not None:
            raise InvalidKeyRequest(f"API key {key_id} is revoked; make a new one")
        current = {field: getattr(record, field) for field in KEY_SETTINGS}
        checked = _checked_settings(
            {**current, **changes}, allow_unknown_models=allow_unknown_models
        )
        changed = {f: (current[f], checked[f]) for f in KEY_SETTINGS if current[f] != checked[f]}
        if not changed:
            return record
        for field, (_, after) in changed.items():
            setattr(record, field, after)
        record.save(update_fields=list(changed))
        RoutingGeneration.bump()
        what = ", ".join(f"{f} {before!r} → {after!r}" for f, (before, after) in changed.items())
        event_record(
            kind=EventKind.API_KEY_CHANGED,
            worker=None,
            message=f"API key {record.name!r} ({record.prefix}…): {what}",
            actor=actor,
            data={
                "key_id": record.pk,
                "prefix": record.prefix,
                "before": {f: before for f, (before, _) in changed.items()},
                "after": {f: after for f, (_, after) in changed.items()},
            },
        )
    return record


def _checked_settings(settings: dict[str, Any], *, allow_unknown_models: bool) -> dict[str, Any]:
    """The settings as they will be stored, or InvalidKeyRequest naming what is wrong."""
    name = str(settings["name"]).strip()
    if not name or len(name) > MAX_NAME:
        raise InvalidKeyRequest(f"a key needs a name of 1 to {MAX_NAME} characters")
    allowed = _clean_models(list(settings["allowed_models"] or []))
    unknown = models_unknown(allowed)
    if unknown and not allow_unknown_models:
        raise InvalidKeyRequest(
            f"no model or alias is named {', '.join(map(repr, unknown))}; fix the name, or "
            "accept it on purpose (API: allow_unknown_models, page: the checkbox)"
        )
    for label in ("rpm", "tpm", "daily_tokens", "monthly_tokens"):
        limit = settings[label]
        if limit is not None and limit < 1:
            raise InvalidKeyRequest(f"{label} must be at least 1 (leave it out for no limit)")
    if settings["priority"] not in PRIORITIES:
        raise InvalidKeyRequest(
            f"unknown priority class {settings['priority']!r}; use one of {', '.join(PRIORITIES)}"
        )
    weight = settings["weight"]
    if not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise InvalidKeyRequest(f"weight must be above 0 and at most {MAX_WEIGHT}")
    return {**settings, "name": name, "allowed_models": allowed, "weight": float(weight)}


def api_key_revoke(*, key_id: int, actor: str) -> ApiKey:
    """Revoked at once in every router (within a snapshot poll); the row and its usage stay."""
    with transaction.atomic():
        record = ApiKey.objects.select_for_update().filter(pk=key_id).first()
        if record is None:
            raise KeyNotFound(f"no API key {key_id}")
        if record.revoked_at is None:
            record.revoked_at = timezone.now()
            record.save(update_fields=["revoked_at"])
            RoutingGeneration.bump()
            _key_event(EventKind.API_KEY_REVOKED, record, actor, "revoked")
    return record


def _key_event(kind: str, record: ApiKey, actor: str, what: str) -> None:
    """The audit trail names the key by its public prefix; the secret is never logged."""
    limits = {
        "models": record.allowed_models, "rpm": record.rpm, "tpm": record.tpm,
        "priority": record.priority, "weight": record.weight,
        "daily_tokens": record.daily_tokens, "monthly_tokens": record.monthly_tokens,
    }  # fmt: skip
    event_record(
        kind=kind,
        worker=None,
        message=f"API key {record.name!r} ({record.prefix}…) {what}",
        actor=actor,
        data={"key_id": record.pk, "prefix": record.prefix, **limits,
              **_key_states(what, {"name": record.name, **limits})},
    )  # fmt: skip


def _key_states(what: str, limits: dict[str, Any]) -> dict[str, Any]:
    """before → after for the events page: a new key's settings, a revoked key's state."""
    if what == "revoked":
        return {"before": {"state": "live"}, "after": {"state": "revoked"}}
    return {"before": {}, "after": limits}


def client_keys() -> list[ClientKey]:
    """The live keys as the router needs them: digests, never secrets."""
    return [
        ClientKey(
            id=row.pk,
            name=row.name,
            prefix=row.prefix,
            digest=bytes.fromhex(row.key_hash),
            models=frozenset(row.allowed_models),
            rpm=row.rpm,
            tpm=row.tpm,
            explain=row.can_explain,
            priority=row.priority,
            weight=row.weight,
            daily_tokens=row.daily_tokens,
            monthly_tokens=row.monthly_tokens,
        )
        for row in ApiKey.objects.filter(revoked_at__isnull=True)
    ]


def usage_record(*, usage: UsageBatch, day: date | None = None) -> None:
    """Add a router's counts to the day's rows. Counts of a key deleted meanwhile are
    dropped; there is no one left to bill."""
    day = day or timezone.now().date()
    known = set(ApiKey.objects.filter(pk__in={k for k, _ in usage}).values_list("pk", flat=True))
    with transaction.atomic():
        for (key_id, model), (requests, prompt, completion) in usage.items():
            if key_id not in known:
                continue
            row, _ = KeyUsage.objects.get_or_create(
                api_key_id=key_id, model=model[:MAX_MODEL_NAME], day=day
            )
            # F(): several routers add to the same row; none may overwrite another's counts.
            KeyUsage.objects.filter(pk=row.pk).update(
                requests=F("requests") + requests,
                prompt_tokens=F("prompt_tokens") + prompt,
                completion_tokens=F("completion_tokens") + completion,
            )


def usage_totals(*, since: date | None = None) -> list[dict[str, Any]]:
    """Requests and tokens per key and model, largest first."""
    rows = KeyUsage.objects.all()
    if since is not None:
        rows = rows.filter(day__gte=since)
    totals = (
        rows.values("api_key_id", "api_key__name", "api_key__prefix", "model")
        .annotate(
            requests_total=Sum("requests"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
        )
        .order_by("api_key__name", "api_key_id", "model")
    )
    return [
        {
            "key_id": t["api_key_id"],
            "key_name": t["api_key__name"],
            "prefix": t["api_key__prefix"],
            "model": t["model"],
            "requests": t["requests_total"],
            "prompt_tokens": t["prompt"],
            "completion_tokens": t["completion"],
            "total_tokens": t["prompt"] + t["completion"],
        }
        for t in totals
    ]


def models_unknown(names: list[str]) -> list[str]:
    """The names that are neither a served model (base or LoRA), a worker's model, nor an
    alias now: a key limited to them gets 404s."""
    if not names:
        return []
    known = set(ServedModel.objects.values_list("name", flat=True))
    known |= set(Alias.objects.values_list("name", flat=True))
    for entries in Worker.objects.values_list("models", flat=True):
        known.update(e["id"] for e in entries)
    return [n for n in names if n not in known]


def _clean_models(models: list[str]) -> list[str]:
    cleaned = sorted({m.strip() for m in models if m.strip()})
    too_long = [m for m in cleaned if len(m) > MAX_MODEL_NAME]
    if too_long:
        raise InvalidKeyRequest(f"model names are at most {MAX_MODEL_NAME} characters")
    return cleaned
