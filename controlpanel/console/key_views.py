"""The client keys page (/keys/) and the usage page (/usage/), staff only. Like views.py:
read through selectors, act through controlpanel.keys."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlpanel.fleet import selectors
from controlpanel.keys import services as keys
from controlpanel.keys.budgets import api_key_budgets
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.models import ApiKey
from routing.fleet.priority import PRIORITIES, STANDARD

# The columns' bounds: rpm and tpm are integers, the token budgets big integers.
MAX_RATE, MAX_BUDGET = 2**31 - 1, 2**63 - 1
USAGE_PERIODS = {"today": 0, "7d": 6, "30d": 29, "all": None}  # days before today
# The create form's fields that come back after an error (the key's settings, no secret).
FORM_FIELDS = (
    "name", "models", "rpm", "tpm", "priority", "weight", "daily_tokens", "monthly_tokens",
    "allow_unknown_models", "can_explain",
)  # fmt: skip


def _with_standing(records: Any) -> list[ApiKey]:
    """Each key with the models it names that nothing serves now (shown as a warning) and
    where it stands against its token budgets."""
    listed = list(records)
    standings = api_key_budgets(records=listed)
    for record in listed:
        record.unknown_models = keys.models_unknown(list(record.allowed_models))
        record.budget_standing = standings[record.pk]
    return listed


def _keys_page(request: HttpRequest, issued: keys.IssuedKey | None = None) -> HttpResponse:
    context = {
        "keys": _with_standing(ApiKey.objects.all()),
        "issued": issued,
        "priorities": PRIORITIES,
        "form": request.session.pop("key_form", {"priority": STANDARD, "weight": "1"}),
        "required": settings.CONTROLPANEL_REQUIRE_API_KEY,
        "known_models": sorted(selectors.workers_by_model()),
    }
    response = render(request, "controlpanel/keys.html", context)
    response["Cache-Control"] = "no-store"  # a page with a fresh key must not be kept
    return response


@staff_member_required
def keys_page(request: HttpRequest) -> HttpResponse:
    return _keys_page(request)


@staff_member_required
@require_POST
def key_create(request: HttpRequest) -> HttpResponse:
    """Answers with the page itself rather than a redirect: the new key is in this one
    response and nowhere else (not in the session, not in a message store)."""
    form = request.POST
    try:
        issued = keys.api_key_create(
            name=form.get("name", ""),
            models=form.get("models", "").split(","),
            rpm=_limit(form.get("rpm", ""), MAX_RATE),
            tpm=_limit(form.get("tpm", ""), MAX_RATE),
            actor=request_actor(request),
            allow_unknown_models=form.get("allow_unknown_models") == "1",
            can_explain=form.get("can_explain") == "1",
            **_class_and_budgets(form),
        )
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Key not created: {exc}")
        request.session["key_form"] = {f: form.get(f, "") for f in FORM_FIELDS}
        return redirect("keys")
    return _keys_page(request, issued)


@staff_member_required
@require_POST
def key_update(request: HttpRequest, key_id: int) -> HttpResponse:
    """A live key's class, weight and budgets, from the form under its row; every router
    has them within a second, and the event log gets before and after."""
    try:
        record = keys.api_key_update(
            key_id=key_id, actor=request_actor(request), **_class_and_budgets(request.POST)
        )
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Key not changed: {exc}")
    else:
        messages.success(request, f"Key {record.name} ({record.prefix}…) is saved.")
    return redirect("keys")


def _class_and_budgets(form: Any) -> dict[str, Any]:
    """The fields both forms share, as the service takes them; ValueError names a bad one."""
    return {
        "priority": form.get("priority", STANDARD),
        "weight": _weight(form.get("weight", "")),
        "daily_tokens": _limit(form.get("daily_tokens", "")),
        "monthly_tokens": _limit(form.get("monthly_tokens", "")),
    }


def _weight(raw: str) -> float:
    raw = raw.strip() or "1"
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"the weight is a number, not {raw!r}") from None


@staff_member_required
@require_POST
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    try:
        record = keys.api_key_revoke(key_id=key_id, actor=request_actor(request))
    except ServiceError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Key {record.name} ({record.prefix}…) is revoked.")
    return redirect("keys")


@staff_member_required
def usage_page(request: HttpRequest) -> HttpResponse:
    period = request.GET.get("period", "30d")
    if period not in USAGE_PERIODS:
        period = "30d"
    days = USAGE_PERIODS[period]
    since = None if days is None else timezone.now().date() - timedelta(days=days)
    rows = keys.usage_totals(since=since)
    context = {
        "rows": rows,
        "period": period,
        "periods": list(USAGE_PERIODS),
        "total_requests": sum(r["requests"] for r in rows),
        "total_tokens": sum(r["total_tokens"] for r in rows),
        "keys_required": settings.CONTROLPANEL_REQUIRE_API_KEY,
    }
    return render(request, "controlpanel/usage.html", context)


def _limit(raw: str, top: int = MAX_BUDGET) -> int | None:
    """A limit field: empty means none; anything else must be a whole number that its
    column holds (past it the write fails: a 500, not a message)."""
    raw = raw.strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()):  # "²" is a digit to isdigit(), not to int()
        raise ValueError(f"limits and budgets are whole numbers, not {raw!r}")
    if int(raw) > top:
        raise ValueError(f"limits and budgets are at most {top}, not {raw}")
    return int(raw)
