"""The models page shows a model's and an alias's fallbacks and sets them, keeping refused
input in its form (Django's test client, in process)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client as DjangoClient

from controlpanel.registry.models import Alias, Event, ServedModel

pytestmark = pytest.mark.django_db(transaction=True)
PRIMARY, BACKUP = "fb-primary", "fb-backup"


def _staff_client() -> DjangoClient:
    staff = get_user_model().objects.create_superuser("fb-root", password="fb-password-1")
    page_client = DjangoClient()
    page_client.force_login(staff)
    return page_client


def test_the_models_page_shows_and_sets_fallbacks_keeping_refused_input() -> None:
    ServedModel.objects.create(name=PRIMARY)
    ServedModel.objects.create(name=BACKUP)
    Alias.objects.create(name="fb-chat", targets={PRIMARY: 1})
    page = _staff_client()
    posted = page.post(
        "/models/fallbacks", {"kind": "model", "name": PRIMARY, "fallbacks": f"{BACKUP}, fb-chat"}
    )
    assert posted.status_code == 302
    assert ServedModel.objects.get(name=PRIMARY).fallbacks == [BACKUP, "fb-chat"]
    assert Event.objects.get(kind="model_changed").actor == "user:fb-root"
    shown = page.get("/models/").content.decode()
    assert f"falls back to {BACKUP} → fb-chat" in shown

    page.post("/models/fallbacks", {"kind": "alias", "name": "fb-chat", "fallbacks": "nope, x"})
    shown = page.get("/models/").content.decode()
    assert "Fallbacks of fb-chat not changed: unknown fallback `nope`, `x`" in shown
    assert 'value="nope, x"' in shown  # the refused input is kept in its form
    assert Alias.objects.get(name="fb-chat").fallbacks == []
    page.post("/models/fallbacks", {"kind": "alias", "name": "fb-chat", "fallbacks": BACKUP})
    assert Alias.objects.get(name="fb-chat").fallbacks == [BACKUP]
    assert f"falls back to {BACKUP}" in page.get("/models/").content.decode()
