"""Token budgets on the control plane, in process: GET /api/keys shows where each key stands,
read from the routers' counters in Redis or, without it, from the usage rows; the keys
page's edit form changes a key's class, weight and budgets and refuses bad input.

The test that needs a working Redis runs when REDIS_URL names one: the second CI tier,
which fails rather than skips when Redis is unreachable."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
import redis
from django.contrib.auth import get_user_model
from django.test import Client, override_settings

from controlpanel.keys import services as keys
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, KeyUsage, RoutingGeneration
from routing.admission.budgets import DAY, MONTH, counter_name, period_of
from tests.support.common import ADMIN_HEADERS, REDIS_URL, needs_redis
from tests.support.servers import (
    free_port,
)

pytestmark = pytest.mark.django_db(transaction=True)


def api_keys(**settings: Any) -> dict[str, dict[str, Any]]:
    with override_settings(**settings):
        answer = Client(headers=ADMIN_HEADERS).get("/api/keys")
    assert answer.status_code == 200, answer.content
    return {k["prefix"]: k for k in answer.json()}


def test_without_redis_the_standing_comes_from_the_usage_rows() -> None:
    issued = keys.api_key_create(name="rows", actor="t", daily_tokens=100, monthly_tokens=1000)
    record = issued.record
    today = datetime.now(UTC).date()
    earlier = today.replace(day=1) if today.day > 1 else None
    KeyUsage.objects.create(api_key=record, model="m", day=today, prompt_tokens=20,
                            completion_tokens=10)  # fmt: skip
    KeyUsage.objects.create(api_key=record, model="other", day=today, prompt_tokens=5)
    if earlier is not None:  # the same month, another day
        KeyUsage.objects.create(api_key=record, model="m", day=earlier, prompt_tokens=50)
    last_month = today.replace(day=1) - timedelta(days=1)
    KeyUsage.objects.create(api_key=record, model="m", day=last_month, prompt_tokens=9000)

    budgets = api_keys(REDIS_URL="")[record.prefix]["budgets"]
    now = datetime.now(UTC)
    daily = budgets["daily"]
    assert (daily["limit"], daily["used"], daily["left"]) == (100, 35, 65), daily
    assert datetime.fromisoformat(daily["resets_at"]) == period_of(DAY, now).resets_at
    month_used = 35 + (50 if earlier is not None else 0)
    assert budgets["monthly"]["used"] == month_used
    assert budgets["monthly"]["left"] == 1000 - month_used
    assert (
        datetime.fromisoformat(budgets["monthly"]["resets_at"]) == period_of(MONTH, now).resets_at
    )


def test_an_unreachable_redis_shows_the_usage_rows_instead() -> None:
    record = keys.api_key_create(name="down", actor="t", daily_tokens=10).record
    KeyUsage.objects.create(api_key=record, model="m", day=datetime.now(UTC).date(),
                            prompt_tokens=12)  # fmt: skip
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    daily = api_keys(REDIS_URL=unreachable)[record.prefix]["budgets"]["daily"]
    assert daily["used"] == 12 and daily["left"] == 0


@needs_redis
def test_with_redis_the_standing_is_the_routers_counters() -> None:
    record = keys.api_key_create(name="shared", actor="t", monthly_tokens=500).record
    KeyUsage.objects.create(api_key=record, model="m", day=date.today(), prompt_tokens=1)
    now = datetime.now(UTC)
    namespace = RoutingGeneration.deployment_id()
    store = redis.Redis.from_url(REDIS_URL)
    names = [counter_name(namespace, record.prefix, period_of(k, now)) for k in (DAY, MONTH)]
    try:
        store.set(names[0], 40, ex=60)
        store.set(names[1], 140, ex=60)
        budgets = api_keys(REDIS_URL=REDIS_URL)[record.prefix]["budgets"]
    finally:
        store.delete(*names)
        store.close()
    assert budgets["daily"]["used"] == 40 and budgets["daily"]["limit"] is None
    assert budgets["monthly"]["used"] == 140 and budgets["monthly"]["left"] == 360


def staff_client() -> Client:
    user = get_user_model().objects.create_user("budget-admin", password="x", is_staff=True)
    browser = Client()
    browser.force_login(user)
    return browser


def test_the_edit_form_changes_class_weight_and_budgets_and_refuses_bad_input() -> None:
    record = keys.api_key_create(name="edited", actor="t", daily_tokens=100).record
    browser = staff_client()
    edit = f"/keys/{record.pk}/edit"
    form = {"priority": "critical", "weight": "2.5", "daily_tokens": "", "monthly_tokens": "900"}
    page = browser.post(edit, form, follow=True)
    assert "is saved" in page.content.decode()
    record.refresh_from_db()
    assert (record.priority, record.weight, record.daily_tokens, record.monthly_tokens) == (
        "critical", 2.5, None, 900,
    )  # fmt: skip
    change = Event.objects.filter(kind=EventKind.API_KEY_CHANGED).latest("pk")
    assert (
        change.data["before"]["daily_tokens"] == 100
        and change.data["after"]["daily_tokens"] is None
    )
    assert change.actor == "user:budget-admin"

    for bad, says in (
        ({**form, "monthly_tokens": "-5"}, "whole numbers, not &#x27;-5&#x27;"),
        ({**form, "monthly_tokens": "0"}, "monthly_tokens must be at least 1"),
        ({**form, "weight": "heavy"}, "the weight is a number, not &#x27;heavy&#x27;"),
        ({**form, "weight": "0"}, "weight must be above 0"),
        ({**form, "priority": "vip"}, "unknown priority class"),
    ):
        page = browser.post(edit, bad, follow=True)
        assert page.status_code == 200 and "Key not changed" in page.content.decode(), bad
        assert says in page.content.decode(), (bad, says)
    record.refresh_from_db()
    assert (record.priority, record.weight, record.monthly_tokens) == ("critical", 2.5, 900)
