"""Every admin endpoint that takes a body refuses a field it does not know, naming it, and
changes nothing; /api/docs renders with no network beyond the server itself."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Browser, Route

from controlpanel.registry.models import Alias, ApiKey, Event, ServedModel, Worker, WorkerSource
from tests.conftest import ADMIN_HEADERS, RouterServer
from tests.test_browser import browser  # noqa: F401 - the module's Chromium fixture

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


def test_api_docs_render_with_the_network_blocked(router: RouterServer, browser: Browser) -> None:  # noqa: F811
    elsewhere: list[str] = []

    def only_the_server(route: Route) -> None:
        if route.request.url.startswith(router.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.route("**/*", only_the_server)
    page.goto(f"{router.url}/api/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=10000)
    assert page.locator(".swagger-ui .opblock").count() > 10
    page.screenshot(path="test-artifacts/api-docs-offline.png", full_page=False)
    page.close()
    assert elsewhere == [], elsewhere
