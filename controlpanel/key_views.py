"""The client keys page (/keys/) and the usage page (/usage/), staff only. Like views.py:
read through selectors, act through controlpanel.keys."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlpanel import keys, selectors
from controlpanel.models import ApiKey
from controlpanel.services import ServiceError
from controlpanel.views import _actor

USAGE_PERIODS = {"today": 0, "7d": 6, "30d": 29, "all": None}  # days before today


def _keys_page(request: HttpRequest, issued: keys.IssuedKey | None = None) -> HttpResponse:
    context = {
        "keys": ApiKey.objects.all(),
        "issued": issued,
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
            rpm=_limit(form.get("rpm", "")),
            tpm=_limit(form.get("tpm", "")),
            actor=_actor(request),
        )
    except (ValueError, ServiceError) as exc:
        messages.error(request, f"Key not created: {exc}")
        return redirect("keys")
    return _keys_page(request, issued)


@staff_member_required
@require_POST
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    try:
        record = keys.api_key_revoke(key_id=key_id, actor=_actor(request))
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
    }
    return render(request, "controlpanel/usage.html", context)


def _limit(raw: str) -> int | None:
    """A limit field: empty means none; anything else must be a whole number."""
    raw = raw.strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"limits are whole numbers, not {raw!r}")
    return int(raw)
