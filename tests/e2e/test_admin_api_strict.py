"""Every admin endpoint that takes a body refuses a field it does not know, naming it, and
changes nothing. /api/docs rendering with no network: tests/browser/test_api_docs_browser.py."""

from __future__ import annotations

import httpx
import pytest

from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import Alias, ApiKey, Event, ServedModel, Worker
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import RouterServer

pytestmark = pytest.mark.django_db(transaction=True)


def _fixtures() -> dict[str, int]:
    worker = Worker.objects.create(
        url="http://127.0.0.1:9", name="w", source=WorkerSource.OPERATOR, models=[{"id": "m"}]
    )
    ServedModel.objects.create(name="m")
    Alias.objects.create(name="chat", targets={"m": 100})
    return {"worker": worker.pk}


ENDPOINTS = [
    ("POST", "/api/workers", {"url": "http://127.0.0.1:9"}),
    ("PATCH", "/api/workers/{worker}", {"name": "x"}),
    ("POST", "/api/workers/{worker}/loras", {"lora_name": "a", "lora_path": "/a"}),
    ("PATCH", "/api/models/m", {"policy": "round_robin"}),
    ("POST", "/api/keys", {"name": "k"}),
    ("POST", "/api/aliases", {"name": "a2", "targets": {"m": 100}}),
    ("PATCH", "/api/aliases/chat", {"targets": {"m": 100}}),
    ("POST", "/api/rollouts", {"alias": "chat", "to_target": "m",
                               "steps": [{"weight": 100, "hold_seconds": 1}]}),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_unknown_fields_are_a_422_that_names_them(
    router: RouterServer, method: str, path: str, body: dict[str, object]
) -> None:
    ids = _fixtures()
    before = (Event.objects.count(), ApiKey.objects.count(), Worker.objects.count())
    answer = httpx.request(
        method,
        router.url + path.format(**ids),
        json={**body, "modles": ["m"], "colour": 1},
        headers=ADMIN_HEADERS,
        timeout=10,
    )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["type"] == "UnknownFieldError"
    assert "`modles`" in error["message"] and "`colour`" in error["message"]
    assert (Event.objects.count(), ApiKey.objects.count(), Worker.objects.count()) == before


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_text_with_a_nul_character_is_a_422_not_a_database_error(
    router: RouterServer, method: str, path: str, body: dict[str, object]
) -> None:
    """PostgreSQL cannot store NUL: found by the fuzz test on CI's PostgreSQL tier."""
    ids = _fixtures()
    before = (Event.objects.count(), ApiKey.objects.count(), Worker.objects.count())
    # In a string field, or else in a key of the first mapping (an alias's targets).
    field, value = next(iter(body.items()))
    poisoned = "a\u0000b" if isinstance(value, str) else {f"{k}\u0000": v for k, v in value.items()}  # type: ignore[attr-defined]
    answer = httpx.request(
        method, router.url + path.format(**ids), json={**body, field: poisoned},
        headers=ADMIN_HEADERS, timeout=10,
    )  # fmt: skip
    assert answer.status_code == 422, answer.text
    assert "NUL character" in answer.json()["error"]["message"]
    assert (Event.objects.count(), ApiKey.objects.count(), Worker.objects.count()) == before
