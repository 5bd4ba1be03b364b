"""Where each client key stands against its token budgets this UTC day and month: used,
left and the reset (for GET /api/keys and the keys page).

The used counts are the ones the routers enforce (routing.admission.budgets): their counters in
Redis
when REDIS_URL is set. Without Redis, or when Redis cannot be read, they are summed from
the usage rows the routers report (KeyUsage, one row per key, model and UTC day, written by
each router about every two seconds): today's rows for the day, this month's for the month.
A read never waits long for Redis: a short timeout, then the rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import date, datetime
from functools import cache
from typing import TYPE_CHECKING

from django.conf import settings
from django.db.models import F, Q, Sum
from django.utils import timezone

from controlpanel.registry.models import ApiKey, KeyUsage, RoutingGeneration
from routing.admission import budgets

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

BUDGET_NAMES = {budgets.DAY: "daily", budgets.MONTH: "monthly"}  # as the API names them


@dataclass(frozen=True)
class BudgetStanding:
    """Where a key stands in one period: `limit` and `left` are None without a budget."""

    limit: int | None
    used: int
    left: int | None
    resets_at: datetime


def api_key_budgets(
    *, records: list[ApiKey], now: datetime | None = None
) -> dict[int, dict[str, BudgetStanding]]:
    """Each key's standing this UTC day and month ("daily", "monthly"): the used counts the
    routers enforce, from Redis when REDIS_URL is set (and answering), else the usage rows
    the routers report (written about every two seconds, per process)."""
    now = now or timezone.now()
    periods = {kind: budgets.period_of(kind, now) for kind in budgets.KINDS}
    used = _budget_used_shared(records, periods)
    if used is None:
        used = _budget_used_reported(records, periods)
    limits = {budgets.DAY: "daily_tokens", budgets.MONTH: "monthly_tokens"}
    return {
        record.pk: {
            BUDGET_NAMES[kind]: _standing(
                getattr(record, limits[kind]), used.get((record.pk, kind), 0), period
            )
            for kind, period in periods.items()
        }
        for record in records
    }


def _standing(limit: int | None, used: int, period: budgets.Period) -> BudgetStanding:
    left = None if limit is None else max(0, limit - used)
    return BudgetStanding(limit=limit, used=used, left=left, resets_at=period.resets_at)


@cache
def _redis(url: str) -> redis.Redis:
    # Imported here: only with REDIS_URL set is it used, and redis (with the cryptography and
    # opentelemetry it loads) costs every process that imports this module ~9 MiB.
    import redis

    # Short timeouts: a page or an API answer falls back to the usage rows, never hangs.
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)


def _budget_used_shared(
    records: list[ApiKey], periods: dict[str, budgets.Period]
) -> dict[tuple[int, str], int] | None:
    """The routers' counters in Redis (routing.admission.budgets), or None without Redis."""
    namespace = RoutingGeneration.deployment_id()
    if not settings.REDIS_URL or not namespace or not records:
        return None
    slots = [(r, kind, period) for r in records for kind, period in periods.items()]
    names = [budgets.counter_name(namespace, r.prefix, p) for r, _, p in slots]
    from redis.exceptions import RedisError  # loaded by _redis() anyway

    try:
        values = _redis(settings.REDIS_URL).mget(names)
    except (RedisError, OSError) as exc:
        log.warning("budget counters unreadable in Redis (%s); showing reported usage", exc)
        return None
    return {(r.pk, kind): int(v or 0) for (r, kind, _), v in zip(slots, values, strict=True)}


def _budget_used_reported(
    records: list[ApiKey], periods: dict[str, budgets.Period]
) -> dict[tuple[int, str], int]:
    """The usage rows: today's, and this month's (rows are per UTC day)."""
    day = date.fromisoformat(periods[budgets.DAY].label)
    tokens = F("prompt_tokens") + F("completion_tokens")
    rows = (
        KeyUsage.objects.filter(api_key__in=records, day__gte=day.replace(day=1), day__lte=day)
        .values("api_key_id")
        .annotate(daily=Sum(tokens, filter=Q(day=day)), monthly=Sum(tokens))
    )
    used: dict[tuple[int, str], int] = {}
    for row in rows:
        used[row["api_key_id"], budgets.DAY] = row["daily"] or 0
        used[row["api_key_id"], budgets.MONTH] = row["monthly"] or 0
    return used
