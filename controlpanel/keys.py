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

from controlpanel.models import ApiKey, EventKind, KeyUsage, RoutingGeneration
from controlpanel.services import ServiceError, event_record
from routing.auth import PREFIX_LENGTH, ClientKey, new_key
from routing.usage import UsageBatch

MAX_NAME = 200
MAX_MODEL_NAME = 300


class InvalidKeyRequest(ServiceError):
    status = 422


class KeyNotFound(ServiceError):
    status = 404


@dataclass(frozen=True)
class IssuedKey:
    """A key just made: `secret` is the only copy there will ever be of it."""

    record: ApiKey
    secret: str


def api_key_create(
    *,
    name: str,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    actor: str,
) -> IssuedKey:
    name = name.strip()
    if not name or len(name) > MAX_NAME:
        raise InvalidKeyRequest(f"a key needs a name of 1 to {MAX_NAME} characters")
    allowed = _clean_models(models or [])
    for label, limit in (("rpm", rpm), ("tpm", tpm)):
        if limit is not None and limit < 1:
            raise InvalidKeyRequest(f"{label} must be at least 1 (leave it out for no limit)")
    secret = new_key()
    with transaction.atomic():
        record = ApiKey.objects.create(
            name=name,
            prefix=secret[:PREFIX_LENGTH],
            key_hash=hashlib.sha256(secret.encode()).hexdigest(),
            allowed_models=allowed,
            rpm=rpm,
            tpm=tpm,
            created_by=actor,
        )
        RoutingGeneration.bump()  # routers learn the key with their next snapshot
        _key_event(EventKind.API_KEY_CREATED, record, actor, "created")
    return IssuedKey(record=record, secret=secret)


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
    limits = {"models": record.allowed_models, "rpm": record.rpm, "tpm": record.tpm}
    event_record(
        kind=kind,
        worker=None,
        message=f"API key {record.name!r} ({record.prefix}…) {what}",
        actor=actor,
        data={"key_id": record.pk, "prefix": record.prefix, **limits},
    )


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


def _clean_models(models: list[str]) -> list[str]:
    cleaned = sorted({m.strip() for m in models if m.strip()})
    too_long = [m for m in cleaned if len(m) > MAX_MODEL_NAME]
    if too_long:
        raise InvalidKeyRequest(f"model names are at most {MAX_MODEL_NAME} characters")
    return cleaned
