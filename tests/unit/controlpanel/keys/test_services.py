"""Client API keys (controlpanel.keys.services) on the database: the secret shown once and
kept only as its digest, settings checked, changes and revocation audited without the
secret, what routers get, and usage added by several routers without losing counts."""

from __future__ import annotations

import hashlib
from datetime import date
from typing import Any

import pytest

from controlpanel.keys import services
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import ApiKey, Event, KeyUsage, RoutingGeneration, ServedModel
from routing.admission.auth import PREFIX_LENGTH

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def served() -> None:
    ServedModel.objects.get_or_create(name="m")


def issue(**options: Any) -> services.IssuedKey:
    options.setdefault("name", "team")
    return services.api_key_create(actor="ops", **options)


def test_a_key_is_kept_as_its_digest_and_its_secret_never_logged() -> None:
    before = RoutingGeneration.current()
    issued = issue(name="  team  ", models=[" m ", "m"], rpm=60)
    record = ApiKey.objects.get(pk=issued.record.pk)
    assert record.key_hash == hashlib.sha256(issued.secret.encode()).hexdigest()
    assert record.prefix == issued.secret[:PREFIX_LENGTH] and issued.secret not in str(
        ApiKey.objects.values().get()
    )
    assert (record.name, record.allowed_models, record.rpm) == ("team", ["m"], 60)
    assert RoutingGeneration.current() != before
    event = Event.objects.get(kind=EventKind.API_KEY_CREATED)
    assert event.message == f"API key 'team' ({record.prefix}…) created"
    assert event.data["after"]["rpm"] == 60 and issued.secret not in str(event.data)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"name": " "}, "needs a name"),
        ({"name": "x" * 201}, "needs a name"),
        ({"models": ["mm"]}, "no model or alias is named 'mm'"),
        ({"models": ["x" * 301]}, "at most 300 characters"),
        ({"rpm": 0}, "rpm must be at least 1"),
        ({"monthly_tokens": -5}, "monthly_tokens must be at least 1"),
        ({"priority": "urgent"}, "unknown priority class 'urgent'"),
        ({"weight": 0}, "weight must be above 0"),
        ({"weight": 1001}, "at most 1000"),
        ({"weight": "2"}, "weight must be above 0"),
    ],
)
def test_bad_settings_are_refused_and_nothing_made(options: dict[str, Any], words: str) -> None:
    with pytest.raises(services.InvalidKeyRequest, match=words):
        issue(**options)
    assert not ApiKey.objects.exists()


def test_an_unknown_model_may_be_accepted_on_purpose() -> None:
    issued = issue(models=["coming-soon"], allow_unknown_models=True)
    assert issued.record.allowed_models == ["coming-soon"]
    assert services.models_unknown(["m", "coming-soon"]) == ["coming-soon"]


def test_an_update_logs_only_what_changed() -> None:
    key = issue(rpm=10).record
    updated = services.api_key_update(key_id=key.pk, actor="ops", rpm=20, name="team")
    assert updated.rpm == 20
    event = Event.objects.get(kind=EventKind.API_KEY_CHANGED)
    assert event.data["before"] == {"rpm": 10} and event.data["after"] == {"rpm": 20}
    assert event.message.endswith(": rpm 10 → 20")
    services.api_key_update(key_id=key.pk, actor="ops", rpm=20)
    assert Event.objects.filter(kind=EventKind.API_KEY_CHANGED).count() == 1
    with pytest.raises(services.InvalidKeyRequest, match="no setting key_hash"):
        services.api_key_update(key_id=key.pk, actor="ops", key_hash="0" * 64)
    with pytest.raises(services.InvalidKeyRequest, match="weight"):
        services.api_key_update(key_id=key.pk, actor="ops", weight=-1)
    with pytest.raises(services.KeyNotFound):
        services.api_key_update(key_id=key.pk + 1000, actor="ops", rpm=1)


def test_a_revoked_key_leaves_the_routers_and_stays_revoked() -> None:
    kept, revoked = issue(name="kept").record, issue(name="gone", models=["m"], tpm=5).record
    first = services.api_key_revoke(key_id=revoked.pk, actor="ops")
    again = services.api_key_revoke(key_id=revoked.pk, actor="ops")
    assert first.revoked_at is not None and again.revoked_at == first.revoked_at
    assert Event.objects.filter(kind=EventKind.API_KEY_REVOKED).count() == 1
    (live,) = services.client_keys()
    assert (live.id, live.prefix, live.models) == (kept.pk, kept.prefix, frozenset())
    assert live.digest == bytes.fromhex(kept.key_hash)
    with pytest.raises(services.InvalidKeyRequest, match="is revoked"):
        services.api_key_update(key_id=revoked.pk, actor="ops", rpm=1)
    with pytest.raises(services.KeyNotFound):
        services.api_key_revoke(key_id=revoked.pk + 1000, actor="ops")


def test_usage_from_several_routers_adds_up_and_a_deleted_keys_is_dropped() -> None:
    a, b = issue(name="a").record, issue(name="b").record
    day = date(2026, 1, 2)
    services.usage_record(usage={(a.pk, "m"): (2, 100, 10), (b.pk, "m"): (1, 5, 5)}, day=day)
    services.usage_record(usage={(a.pk, "m"): (3, 50, 20), (10**6, "m"): (9, 9, 9)}, day=day)
    services.usage_record(usage={(a.pk, "m"): (1, 1, 1)}, day=date(2026, 1, 3))
    assert KeyUsage.objects.count() == 3
    totals = services.usage_totals()
    assert [(t["key_name"], t["requests"], t["total_tokens"]) for t in totals] == [
        ("a", 6, 182), ("b", 1, 10),
    ]  # fmt: skip
    later = services.usage_totals(since=date(2026, 1, 3))
    assert [(t["key_name"], t["requests"], t["prompt_tokens"]) for t in later] == [("a", 1, 1)]
