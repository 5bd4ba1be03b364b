"""Django admin: its forms run the same checks as the API (nothing the routers could not
build is saved), each save and delete writes the event a service would (the staff user as
actor, before → after, the API key never shown), state changes go through the services,
and the audit log and the routers' reports are read-only."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import models
from django.forms.models import model_to_dict
from django.test import Client

from controlpanel.console.admin import ServedModelForm
from controlpanel.registry.choices import WorkerSource, WorkerState
from controlpanel.registry.models import Event, ServedModel, Worker
from tests.support.in_process import staff_client

pytestmark = pytest.mark.django_db
ADMIN = "/admin/controlpanel"


def form_data(obj: models.Model, form_fields: Any, **changes: Any) -> dict[str, Any]:
    """The row as its admin form posts it (JSON fields as text), with `changes`."""
    values = {**model_to_dict(obj, fields=list(form_fields)), **changes}
    json_fields = {f.name for f in obj._meta.fields if isinstance(f, models.JSONField)}
    return {
        name: json.dumps(value) if name in json_fields else ("" if value is None else value)
        for name, value in values.items()
    }


def served(**fields: Any) -> ServedModel:
    return ServedModel.objects.create(name="m", **fields)


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"policy": "fastest"}, "policy", "unknown policy 'fastest'"),
        ({"priority_reserve": 1.0}, "priority_reserve", "at least 0 and below 1"),
        ({"fallbacks": ["nope"]}, "fallbacks", "unknown fallback `nope`"),
        ({"tokenizer": "/nonexistent/folder"}, "tokenizer", "cannot be used"),
    ],
)
def test_the_model_form_runs_the_apis_checks(
    changes: dict[str, Any], field: str, says: str
) -> None:
    model = served()
    data = form_data(model, ServedModelForm.base_fields, **changes)
    form = ServedModelForm(data, instance=model)
    assert not form.is_valid()
    assert says in " ".join(form.errors[field])


def test_saving_a_model_in_admin_writes_the_event_with_the_user() -> None:
    model = served()
    browser = staff_client("root")
    data = form_data(model, ServedModelForm.base_fields, max_inflight=7)
    answer = browser.post(f"{ADMIN}/servedmodel/{model.pk}/change/", data)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert ServedModel.objects.get().max_inflight == 7
    event = Event.objects.get(kind="model_changed")
    assert event.actor == "admin:root" and event.data["via"] == "Django admin"
    assert event.data["before"] == {"max_inflight": 0} and event.data["after"] == {
        "max_inflight": 7
    }


def test_deleting_a_model_in_admin_keeps_its_settings_in_the_log() -> None:
    model = served(policy="round_robin")
    browser = staff_client("root")
    answer = browser.post(f"{ADMIN}/servedmodel/{model.pk}/delete/", {"post": "yes"})
    assert answer.status_code == 302
    assert not ServedModel.objects.exists()
    event = Event.objects.get()
    assert event.message == "model m deleted in Django admin"
    assert event.data["before"]["policy"] == "round_robin" and event.data["after"] == {}


def test_worker_actions_go_through_the_services_and_the_key_is_never_shown() -> None:
    one = Worker.objects.create(url="http://127.0.0.1:9", name="w", models=[{"id": "m"}],
                                source=WorkerSource.OPERATOR, api_key="sk-very-secret")  # fmt: skip
    browser = staff_client("root")
    page = browser.get(f"{ADMIN}/worker/{one.pk}/change/").content.decode()
    assert "sk-very-secret" not in page and 'name="api_key"' not in page
    browser.post(f"{ADMIN}/worker/", {"action": "drain", "_selected_action": [one.pk]})
    assert Worker.objects.get(pk=one.pk).state != WorkerState.ACTIVE
    browser.post(f"{ADMIN}/worker/", {"action": "activate", "_selected_action": [one.pk]})
    assert Worker.objects.get(pk=one.pk).state == WorkerState.ACTIVE
    kinds = dict(Event.objects.filter(actor="admin:root").values_list("kind", "actor"))
    assert {"drain_started", "worker_activated"} <= set(kinds)


def test_the_audit_log_and_router_reports_are_read_only() -> None:
    event = Event.objects.create(kind="policy_changed", message="x")
    browser = staff_client("root")
    assert browser.get(f"{ADMIN}/event/").status_code == 200
    assert browser.get(f"{ADMIN}/event/add/").status_code == 403
    assert browser.post(f"{ADMIN}/event/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Event.objects.filter(pk=event.pk).exists()
    assert browser.get(f"{ADMIN}/routerinstance/add/").status_code == 403
    assert Client().get(f"{ADMIN}/event/").status_code == 302  # to the login page
    assert "vLLM Control Panel" in browser.get("/admin/").content.decode()
