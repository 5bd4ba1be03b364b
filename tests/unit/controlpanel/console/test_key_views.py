"""The keys page: a new key shown in that one response (never cached, never in a message
or the session), a refused form kept as typed, a key's class and budgets changed, revoked;
the usage page's periods."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from controlpanel.registry.models import ApiKey, KeyUsage, ServedModel
from tests.support.in_process import staff_client

pytestmark = pytest.mark.django_db


def test_a_new_key_is_shown_once_and_never_kept() -> None:
    ServedModel.objects.create(name="m")
    browser = staff_client()
    answer = browser.post("/keys/new", {"name": "team-a", "models": "m", "rpm": "60"})
    assert answer.status_code == 200 and answer["Cache-Control"] == "no-store"
    record = ApiKey.objects.get()
    page = answer.content.decode()
    shown = [w for w in page.split() if record.prefix in w and len(w) > len(record.prefix) + 8]
    assert shown, "the new key is on the page"
    assert (record.name, record.rpm, list(record.allowed_models)) == ("team-a", 60, ["m"])
    later = browser.get("/keys/").content.decode()
    assert record.prefix in later and shown[0] not in later


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ({"rpm": "sixty"}, "limits and budgets are whole numbers, not 'sixty'"),
        ({"rpm": "-5"}, "limits and budgets are whole numbers, not '-5'"),
        ({"daily_tokens": "²"}, "limits and budgets are whole numbers, not '²'"),
        ({"weight": "heavy"}, "the weight is a number, not 'heavy'"),
        ({"priority": "vip"}, "unknown priority class 'vip'"),
        ({"models": "not-served"}, "no model or alias is named 'not-served'"),
    ],
)
def test_a_refused_form_says_why_and_comes_back_as_typed(form: dict[str, str], says: str) -> None:
    browser = staff_client()
    page = browser.post("/keys/new", {"name": "typed-name", **form}, follow=True)
    text = page.content.decode()
    assert f"Key not created: {says}".replace("'", "&#x27;") in text
    assert 'value="typed-name"' in text
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize(
    ("field", "value", "top"),
    [("daily_tokens", "9" * 30, 2**63 - 1), ("rpm", str(2**31), 2**31 - 1),
     ("tpm", str(2**40), 2**31 - 1)],
)  # fmt: skip
def test_a_limit_too_big_to_store_is_refused_not_a_server_error(
    field: str, value: str, top: int
) -> None:
    page = staff_client().post("/keys/new", {"name": "k", field: value}, follow=True)
    assert page.status_code == 200
    assert f"Key not created: limits and budgets are at most {top}" in page.content.decode()
    assert not ApiKey.objects.exists()


def test_a_keys_class_and_budgets_change_and_a_revoked_key_is_marked() -> None:
    browser = staff_client()
    browser.post("/keys/new", {"name": "k"})
    record = ApiKey.objects.get()
    form = {"priority": "sheddable", "weight": "2", "daily_tokens": "500"}
    saved = browser.post(f"/keys/{record.pk}/edit", form, follow=True)
    assert f"Key k ({record.prefix}…) is saved." in saved.content.decode()
    record.refresh_from_db()
    assert (record.priority, record.weight, record.daily_tokens) == ("sheddable", 2.0, 500)
    revoked = browser.post(f"/keys/{record.pk}/revoke", follow=True)
    assert "is revoked." in revoked.content.decode()
    assert ApiKey.objects.get().revoked_at is not None
    missing = browser.post("/keys/424242/revoke", follow=True).content.decode()
    assert "no API key 424242" in missing


def test_the_usage_page_sums_the_period_asked_for() -> None:
    browser = staff_client()
    browser.post("/keys/new", {"name": "k"})
    key = ApiKey.objects.get()
    today = timezone.now().date()
    for day, requests in ((today, 3), (today - dt.timedelta(days=20), 40)):
        KeyUsage.objects.create(api_key=key, model="m", day=day, requests=requests,
                                prompt_tokens=1, completion_tokens=1)  # fmt: skip
    assert browser.get("/usage/", {"period": "today"}).context["total_requests"] == 3
    assert browser.get("/usage/", {"period": "7d"}).context["total_requests"] == 3
    assert browser.get("/usage/").context["total_requests"] == 43
    assert browser.get("/usage/", {"period": "forever"}).context["total_requests"] == 43
