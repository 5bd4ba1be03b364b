"""Admin API for client keys (/api/keys) and their usage (/api/usage). A key is returned
once, by the POST that creates it; afterwards only its public prefix is ever shown."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema

from controlpanel import keys
from controlpanel.api import ADMIN_AUTH, MAX_INT, _actor
from controlpanel.models import ApiKey

router = Router(auth=ADMIN_AUTH, tags=["keys"])


class KeyIn(Schema):
    name: str = Field(min_length=1, max_length=keys.MAX_NAME)
    # Model or alias names the key may use; absent or empty: every model.
    models: list[str] | None = Field(default=None, max_length=1000)
    rpm: int | None = Field(default=None, ge=1, le=MAX_INT, description="requests per minute")
    tpm: int | None = Field(default=None, ge=1, le=MAX_INT, description="tokens per minute")


class KeyOut(Schema):
    id: int
    name: str
    prefix: str
    models: list[str]
    rpm: int | None
    tpm: int | None
    created_at: datetime
    created_by: str
    revoked_at: datetime | None

    @staticmethod
    def resolve_models(obj: ApiKey) -> list[str]:
        return list(obj.allowed_models)


class IssuedKeyOut(KeyOut):
    key: str = Field(description="the key itself; shown this once and never again")


class UsageOut(Schema):
    key_id: int
    key_name: str
    prefix: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@router.get("/keys", response=list[KeyOut])
def keys_list(request: HttpRequest) -> Any:
    return ApiKey.objects.all()


@router.post("/keys", response={201: IssuedKeyOut})
def keys_create(request: HttpRequest, payload: KeyIn) -> Any:
    issued = keys.api_key_create(
        name=payload.name,
        models=payload.models,
        rpm=payload.rpm,
        tpm=payload.tpm,
        actor=_actor(request),
    )
    # Carried on the row for this one response only; it is never saved.
    issued.record.key = issued.secret  # type: ignore[attr-defined]
    return 201, issued.record


@router.delete("/keys/{int:key_id}", response={204: None})
def keys_revoke(request: HttpRequest, key_id: int) -> Any:
    keys.api_key_revoke(key_id=key_id, actor=_actor(request))
    return 204, None


@router.get("/usage", response=list[UsageOut])
def usage_list(request: HttpRequest, since: date | None = None) -> Any:
    """Requests and tokens per key and model, from `since` (a UTC day) or ever."""
    return keys.usage_totals(since=since)
