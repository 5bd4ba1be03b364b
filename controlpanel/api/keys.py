"""Admin API for client keys (/api/keys) and their usage (/api/usage). A key is returned
once, by the POST that creates it; afterwards only its public prefix is ever shown."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.errors import HttpError

from controlpanel.api.auth import ADMIN_AUTH
from controlpanel.api.limits import MAX_INT
from controlpanel.api.strict import StrictIn
from controlpanel.keys import services as keys
from controlpanel.keys.budgets import api_key_budgets
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.models import ApiKey
from routing.fleet.priority import PRIORITIES, STANDARD

router = Router(auth=ADMIN_AUTH, tags=["keys"])

MAX_BIG = 2**63 - 1
PRIORITY_HELP = f"its requests' class under saturation: {', '.join(PRIORITIES)}"
WEIGHT_HELP = "its share of admitted capacity against its class's other keys (default 1)"
DAILY_HELP = "prompt + completion tokens per UTC day; null: no budget"
MONTHLY_HELP = "prompt + completion tokens per UTC month; null: no budget"


class KeyIn(StrictIn):
    name: str = Field(min_length=1, max_length=keys.MAX_NAME)
    # Model or alias names the key may use; absent or empty: every model.
    models: list[str] | None = Field(default=None, max_length=1000)
    rpm: int | None = Field(default=None, ge=1, le=MAX_INT, description="requests per minute")
    tpm: int | None = Field(default=None, ge=1, le=MAX_INT, description="tokens per minute")
    # Keep model names nothing serves now (a model about to be added); else they are a 422.
    allow_unknown_models: bool = False
    # May send X-Route-Explain: 1 and get the routing decision explained in the answer.
    explain: bool = False
    priority: str = Field(default=STANDARD, max_length=16, description=PRIORITY_HELP)
    weight: float = Field(default=1.0, description=WEIGHT_HELP)
    daily_tokens: int | None = Field(default=None, le=MAX_BIG, description=DAILY_HELP)
    monthly_tokens: int | None = Field(default=None, le=MAX_BIG, description=MONTHLY_HELP)


class KeyPatch(StrictIn):
    """Only what is sent changes; `null` removes a limit or budget."""

    name: str | None = Field(default=None, min_length=1, max_length=keys.MAX_NAME)
    models: list[str] | None = Field(default=None, max_length=1000)
    rpm: int | None = Field(default=None, le=MAX_INT, description="requests per minute")
    tpm: int | None = Field(default=None, le=MAX_INT, description="tokens per minute")
    allow_unknown_models: bool = False
    explain: bool | None = None
    priority: str | None = Field(default=None, max_length=16, description=PRIORITY_HELP)
    weight: float | None = Field(default=None, description=WEIGHT_HELP)
    daily_tokens: int | None = Field(default=None, le=MAX_BIG, description=DAILY_HELP)
    monthly_tokens: int | None = Field(default=None, le=MAX_BIG, description=MONTHLY_HELP)


class BudgetOut(Schema):
    limit: int | None = Field(description="the budget; null: none (used is still counted)")
    used: int = Field(description="prompt + completion tokens in the period so far")
    left: int | None
    resets_at: datetime = Field(description="the start of the next UTC day or month")


class BudgetsOut(Schema):
    daily: BudgetOut
    monthly: BudgetOut


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
    explain: bool = Field(alias="can_explain")  # may ask for X-Route-Explain
    priority: str
    weight: float
    daily_tokens: int | None
    monthly_tokens: int | None
    # The key's models that no worker serves and no alias names now: it gets 404s for them.
    unknown_models: list[str]
    budgets: BudgetsOut  # where the key stands this UTC day and month

    @staticmethod
    def resolve_models(obj: ApiKey) -> list[str]:
        return list(obj.allowed_models)

    @staticmethod
    def resolve_budgets(obj: ApiKey) -> Any:
        known = getattr(obj, "budget_standing", None)  # keys_list reads all keys at once
        return known if known is not None else api_key_budgets(records=[obj])[obj.pk]

    @staticmethod
    def resolve_unknown_models(obj: ApiKey) -> list[str]:
        return keys.models_unknown(list(obj.allowed_models))


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
    records = list(ApiKey.objects.all())  # evaluated here: an outage is a 503, not a 500
    standings = api_key_budgets(records=records)  # one read for every key
    for record in records:
        record.budget_standing = standings[record.pk]  # type: ignore[attr-defined]
    return records


@router.post("/keys", response={201: IssuedKeyOut})
def keys_create(request: HttpRequest, payload: KeyIn) -> Any:
    issued = keys.api_key_create(
        name=payload.name,
        models=payload.models,
        rpm=payload.rpm,
        tpm=payload.tpm,
        actor=request_actor(request),
        allow_unknown_models=payload.allow_unknown_models,
        can_explain=payload.explain,
        priority=payload.priority,
        weight=payload.weight,
        daily_tokens=payload.daily_tokens,
        monthly_tokens=payload.monthly_tokens,
    )
    # Carried on the row for this one response only; it is never saved.
    issued.record.key = issued.secret  # type: ignore[attr-defined]
    return 201, issued.record


@router.patch("/keys/{int:key_id}", response=KeyOut)
def keys_update(request: HttpRequest, key_id: int, payload: KeyPatch) -> Any:
    """Change a live key's limits, class, weight or budgets: in every router within a
    second. The key itself never changes (revoke it and make a new one for that)."""
    sent = payload.model_dump(exclude_unset=True)
    allow_unknown = sent.pop("allow_unknown_models", False)
    for field in ("name", "models", "explain", "priority", "weight"):  # named as sent
        if field in sent and sent[field] is None:
            raise HttpError(422, f"`{field}` cannot be null")
    renamed = {"models": "allowed_models", "explain": "can_explain"}
    changes = {renamed.get(field, field): value for field, value in sent.items()}
    if not changes:
        raise HttpError(422, f"send at least one of {', '.join(KeyPatch.model_fields)}")
    return keys.api_key_update(
        key_id=key_id, actor=request_actor(request), allow_unknown_models=allow_unknown,
        **changes,
    )  # fmt: skip


@router.delete("/keys/{int:key_id}", response={204: None})
def keys_revoke(request: HttpRequest, key_id: int) -> Any:
    keys.api_key_revoke(key_id=key_id, actor=request_actor(request))
    return 204, None


@router.get("/usage", response=list[UsageOut])
def usage_list(request: HttpRequest, since: date | None = None) -> Any:
    """Requests and tokens per key and model, from `since` (a UTC day) or ever."""
    return keys.usage_totals(since=since)
