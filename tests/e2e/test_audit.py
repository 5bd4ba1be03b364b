"""The audit trail (#17 part 5): every admin change, from the admin API, the dashboard's
forms, Django admin's change forms and a management command, is an event naming the actor
and the changed fields before → after, and no secret (a worker's upstream key, a client
key, its hash) is ever in an event's message or data. Real router process, simulated
workers; Django admin's forms in-process through the test client."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import httpx
import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client as DjangoClient
from django.test import RequestFactory

from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import ApiKey, Event, ServedModel, Worker
from tests.support.common import ADMIN_HEADERS
from tests.support.login import logged_in
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)
WORKER_KEY = "wk-audit-5e1f0c"


def last(kind: str, **where: Any) -> Event:
    event = Event.objects.filter(kind=kind, **where).order_by("-pk").first()
    assert event is not None, (kind, list(Event.objects.values_list("kind", "message")))
    return event


def assert_no_secret(*secrets: str) -> None:
    """No event's message, subject or data holds any of the secrets, nor a key's hash."""
    hashes = list(ApiKey.objects.values_list("key_hash", flat=True))
    for event in Event.objects.all():
        text = event.message + event.subject + json.dumps(event.data)
        for secret in [*secrets, *hashes]:
            assert secret not in text, (event.kind, event.message, event.data)


def test_admin_api_changes_are_events_with_actor_and_before_after(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("audit-api", api_key=WORKER_KEY)
    added = router.post(
        "/api/workers", json={"url": sim.url, "name": "gpu-a", "api_key": WORKER_KEY},
        headers=ADMIN_HEADERS,
    )  # fmt: skip
    assert added.status_code == 201, added.text
    worker = Worker.objects.get(pk=added.json()["id"])
    joined = last(EventKind.WORKER_JOINED, worker=worker)
    assert joined.actor == "admin-token" and joined.data["after"]["api_key"] == "set"

    patch = {"name": "gpu-a2", "weight": 2.5, "kv_events": "tcp://127.0.0.1:5557"}
    answer = httpx.patch(f"{router.url}/api/workers/{worker.pk}", json=patch, headers=ADMIN_HEADERS)
    assert answer.status_code == 200, answer.text
    changed = last(EventKind.WORKER_CHANGED, worker=worker)
    assert changed.actor == "admin-token"
    assert changed.data["before"] == {"name": "gpu-a", "weight": 1.0, "kv_events": ""}
    assert changed.data["after"] == {"name": "gpu-a2", "weight": 2.5,
                                     "kv_events": "tcp://127.0.0.1:5557"}  # fmt: skip
    assert "weight 1.0 → 2.5" in changed.message and "name gpu-a → gpu-a2" in changed.message

    rotated = httpx.patch(
        f"{router.url}/api/workers/{worker.pk}", json={"api_key": "wk-new-99"},
        headers=ADMIN_HEADERS,
    )  # fmt: skip
    assert rotated.status_code == 200, rotated.text
    key_event = last(EventKind.WORKER_KEY_CHANGED, worker=worker)
    assert key_event.data["before"] == {"api_key": "set"}
    assert key_event.data["after"] == {"api_key": "rotated"}

    limit = httpx.patch(
        f"{router.url}/api/models/audit-api", json={"max_inflight": 4}, headers=ADMIN_HEADERS
    )
    assert limit.status_code == 200, limit.text
    model_event = last(EventKind.POLICY_CHANGED, data__model="audit-api")
    assert model_event.data["before"] == {"max_inflight": 0}
    assert model_event.data["after"] == {"max_inflight": 4}
    assert model_event.actor == "admin-token"

    drained = router.post(f"/api/workers/{worker.pk}/drain?force=1", headers=ADMIN_HEADERS)
    assert drained.status_code == 200, drained.text
    drain = last(EventKind.DRAIN_STARTED, worker=worker)
    assert drain.data["before"] == {"state": "active"}
    assert drain.data["after"] == {"state": "draining"}
    assert_no_secret(WORKER_KEY, "wk-new-99")


def test_key_and_alias_changes_through_the_api(router: RouterServer) -> None:
    ServedModel.objects.create(name="audit-m")
    created = router.post(
        "/api/keys", json={"name": "team-a", "models": ["audit-m"], "rpm": 10},
        headers=ADMIN_HEADERS,
    )  # fmt: skip
    assert created.status_code == 201, created.text
    secret, key_id = created.json()["key"], created.json()["id"]
    event = last(EventKind.API_KEY_CREATED)
    assert event.actor == "admin-token" and event.data["after"]["rpm"] == 10
    updated = httpx.patch(
        f"{router.url}/api/keys/{key_id}",
        json={"rpm": 20, "priority": "critical", "daily_tokens": 5000},
        headers=ADMIN_HEADERS,
    )
    assert updated.status_code == 200, updated.text
    change = last(EventKind.API_KEY_CHANGED)
    assert change.data["before"] == {"rpm": 10, "priority": "standard", "daily_tokens": None}
    assert change.data["after"] == {"rpm": 20, "priority": "critical", "daily_tokens": 5000}
    revoked = httpx.delete(f"{router.url}/api/keys/{key_id}", headers=ADMIN_HEADERS)
    assert revoked.status_code in (200, 204), revoked.text
    assert last(EventKind.API_KEY_REVOKED).data["after"] == {"state": "revoked"}

    alias = router.post(
        "/api/aliases", json={"name": "chat-a", "targets": {"audit-m": 100}},
        headers=ADMIN_HEADERS,
    )  # fmt: skip
    assert alias.status_code == 201, alias.text
    moved = httpx.patch(
        f"{router.url}/api/aliases/chat-a",
        json={"targets": {"audit-m": 90, "audit-n": 10}, "description": "for the chat app"},
        headers=ADMIN_HEADERS,
    )
    assert moved.status_code == 200, moved.text
    trail = list(Event.objects.filter(kind=EventKind.ALIAS_CHANGED).order_by("pk"))
    assert [e.data["before"] for e in trail] == [
        {}, {"targets": {"audit-m": 100}}, {"description": ""},
    ]  # fmt: skip
    assert trail[1].data["after"] == {"targets": {"audit-m": 90, "audit-n": 10}}
    assert trail[2].data["after"] == {"description": "for the chat app"}
    assert_no_secret(secret)


def test_dashboard_forms_log_the_staff_user_and_mask_the_key(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("audit-dash"), name="gpu-d")
    session = logged_in(router)
    token = session.cookies["csrftoken"]

    def post(path: str, **data: str) -> None:
        answer = session.post(path, data={**data, "csrfmiddlewaretoken": token})
        assert answer.status_code == 302, answer.text[:300]

    post(f"/workers/{worker.pk}/kv-events", kv_events="tcp://127.0.0.1:5591")
    changed = last(EventKind.WORKER_CHANGED, worker=worker)
    assert changed.actor == "user:op"
    assert changed.data["before"] == {"kv_events": ""}
    assert changed.data["after"] == {"kv_events": "tcp://127.0.0.1:5591"}
    post(f"/workers/{worker.pk}/api-key", api_key=WORKER_KEY)
    key_event = last(EventKind.WORKER_KEY_CHANGED, worker=worker)
    assert key_event.actor == "user:op" and key_event.data["after"] == {"api_key": "set"}
    post("/models/policy", model="audit-dash", policy="round_robin", policy_config="{}")
    policy = last(EventKind.POLICY_CHANGED, data__model="audit-dash")
    assert policy.actor == "user:op"
    assert policy.data["before"]["policy"] == "shortest_queue"
    assert policy.data["after"]["policy"] == "round_robin"
    # The events page shows what changed, before → after, on the entry's line.
    page = session.get("/events/?kind=worker_changed").text
    assert "kv_events &quot;&quot; → tcp://127.0.0.1:5591" in page  # the line says it
    page = session.get("/events/?kind=policy_changed").text
    assert 'data-testid="event-changes"' in page and "round_robin" in page
    assert WORKER_KEY not in session.get("/events/").text
    assert_no_secret(WORKER_KEY)


def _admin_client() -> DjangoClient:
    staff = get_user_model().objects.create_superuser("root", password="root-password-1")
    django_client = DjangoClient()
    django_client.force_login(staff)
    return django_client


def _change_form(model_admin: Any, obj: Any, **changes: Any) -> dict[str, Any]:
    """The admin change form's fields as the page would post them back, with `changes`."""
    request = RequestFactory().get("/")
    request.user = get_user_model().objects.get(username="root")
    form = model_admin.get_form(request, obj)(instance=obj)
    data: dict[str, Any] = {}
    for name in form.fields:
        value = form[name].value()
        if value is None or value is False:
            continue
        data[name] = value
    return {**data, **changes}


def test_django_admin_saves_and_deletes_are_events_by_the_staff_user(
    router: RouterServer,
) -> None:
    worker = Worker.objects.create(url="http://127.0.0.1:9/", name="gpu-x", source="operator",
                                   api_key=WORKER_KEY)  # fmt: skip
    model = ServedModel.objects.create(name="audit-admin")
    django_client = _admin_client()
    worker_form = _change_form(admin.site._registry[Worker], worker, weight="3", name="gpu-y")
    answer = django_client.post(f"/admin/controlpanel/worker/{worker.pk}/change/", worker_form)
    assert answer.status_code == 302, answer.content[:2000]
    changed = last(EventKind.WORKER_CHANGED, worker=worker)
    assert changed.actor == "admin:root"
    assert changed.data["before"] == {"name": "gpu-x", "weight": 1.0}
    assert changed.data["after"] == {"name": "gpu-y", "weight": 3.0}
    assert Worker.objects.get(pk=worker.pk).api_key == WORKER_KEY  # not in the form: kept

    model_form = _change_form(admin.site._registry[ServedModel], model,
                              max_inflight="8", priority_reserve="0.3")  # fmt: skip
    path = f"/admin/controlpanel/servedmodel/{model.pk}/change/"
    answer = django_client.post(path, model_form)
    assert answer.status_code == 302, answer.content[:2000]
    model_event = last(EventKind.MODEL_CHANGED)
    assert model_event.actor == "admin:root"
    assert model_event.data["before"] == {"max_inflight": 0, "priority_reserve": 0.2}
    assert model_event.data["after"] == {"max_inflight": 8, "priority_reserve": 0.3}
    assert model_event.message == (
        "model audit-admin: max_inflight 0 → 8, priority_reserve 0.2 → 0.3"
    )

    path = f"/admin/controlpanel/servedmodel/{model.pk}/delete/"
    assert django_client.post(path, {"post": "yes"}).status_code == 302
    deleted = last(EventKind.MODEL_CHANGED)
    assert deleted.message == "model audit-admin deleted in Django admin"
    assert deleted.data["before"]["max_inflight"] == 8 and deleted.data["after"] == {}
    path = f"/admin/controlpanel/worker/{worker.pk}/delete/"
    assert django_client.post(path, {"post": "yes"}).status_code == 302
    assert last(EventKind.WORKER_LEFT).actor == "admin:root"
    assert_no_secret(WORKER_KEY)


def test_django_admin_refuses_what_the_api_refuses_and_saves_nothing(
    router: RouterServer,
) -> None:
    model = ServedModel.objects.create(name="audit-strict")
    ServedModel.objects.create(name="audit-other", fallbacks=["audit-strict"])
    django_client = _admin_client()
    path = f"/admin/controlpanel/servedmodel/{model.pk}/change/"
    registered = admin.site._registry[ServedModel]
    for changes, why in [
        ({"priority_reserve": "1.5"}, "priority_reserve must be at least 0 and below 1"),
        ({"policy": "no_such_policy"}, "no_such_policy"),
        ({"policy": "kv_aware", "policy_config": '{"block_size": 0}'}, "block_size"),
        ({"tokenizer": "/no/such/folder"}, "cannot be used"),
        ({"fallbacks": '["audit-other"]'}, "loop"),
        ({"fallbacks": '"audit-other"'}, "a list of model or alias names"),
    ]:
        before = Event.objects.count()
        answer = django_client.post(path, _change_form(registered, model, **changes))
        assert answer.status_code == 200, (changes, answer.status_code)  # the form again
        assert why in answer.content.decode(), (changes, answer.content[:3000])
        assert Event.objects.count() == before
    stored = ServedModel.objects.get(pk=model.pk)
    assert (stored.priority_reserve, stored.policy, stored.tokenizer, stored.fallbacks) == (
        0.2,
        "shortest_queue",
        "",
        [],
    )


def test_a_management_command_is_the_actor_of_its_change(router: RouterServer) -> None:
    out, err = StringIO(), StringIO()
    call_command("create_api_key", "ci", "--rpm", "7", "--priority", "sheddable",
                 stdout=out, stderr=err)  # fmt: skip
    secret = out.getvalue().strip()
    event = last(EventKind.API_KEY_CREATED)
    assert event.actor == "manage.py create_api_key"
    assert event.data["before"] == {}
    assert event.data["after"]["rpm"] == 7 and event.data["after"]["priority"] == "sheddable"
    assert_no_secret(secret)


def test_rollout_transitions_are_events_with_state_before_and_after(router: RouterServer) -> None:
    for i, model in enumerate(("r-v1", "r-v2")):
        Worker.objects.create(url=f"http://10.9.0.{i}:8000", name=f"r{i}", source="operator",
                              models=[{"id": model}])  # fmt: skip
    alias = router.post(
        "/api/aliases", json={"name": "chat-r", "targets": {"r-v1": 100}}, headers=ADMIN_HEADERS
    )
    assert alias.status_code == 201, alias.text
    steps = [{"weight": 10, "hold_seconds": 600}, {"weight": 100, "hold_seconds": 0}]
    created = router.post(
        "/api/rollouts", json={"alias": "chat-r", "to_target": "r-v2", "steps": steps},
        headers=ADMIN_HEADERS,
    )  # fmt: skip
    assert created.status_code == 201, created.text
    plan = created.json()["id"]
    for action in ("pause", "resume", "abort"):
        answer = router.post(f"/api/rollouts/{plan}/{action}", headers=ADMIN_HEADERS)
        assert answer.status_code == 200, answer.text
    trail = Event.objects.filter(kind=EventKind.ROLLOUT, data__plan=plan).order_by("pk")
    assert [(e.data["before"], e.data["after"]) for e in trail] == [
        ({}, {"state": "scheduled"}),
        ({"state": "scheduled"}, {"state": "running"}),
        ({"state": "running"}, {"state": "paused"}),
        ({"state": "paused"}, {"state": "running"}),
        ({"state": "running"}, {"state": "aborted"}),
    ]
    assert {e.actor for e in trail} == {"admin-token"}
    weights = last(EventKind.ALIAS_CHANGED, message__contains=f"rollout #{plan}")
    assert weights.data["before"] == {"targets": {"r-v1": 100}}
    assert weights.data["after"] == {"targets": {"r-v1": 90, "r-v2": 10}}


def test_a_worker_added_in_django_admin_is_an_event_by_the_staff_user(
    router: RouterServer,
) -> None:
    django_client = _admin_client()
    form = _change_form(admin.site._registry[Worker], Worker(), url="http://127.0.0.1:9/",
                        name="gpu-new", weight="1.5")  # fmt: skip
    answer = django_client.post("/admin/controlpanel/worker/add/", form)
    assert answer.status_code == 302, answer.content[:3000]
    joined = last(EventKind.WORKER_JOINED)
    assert joined.actor == "admin:root" and joined.worker == Worker.objects.get(name="gpu-new")
    assert joined.message == "worker gpu-new added in Django admin"
    assert joined.data["after"]["weight"] == 1.5 and joined.data["before"] == {}
