"""The audit trail on the events page, in real headless Chromium against the real server:
changes made from the admin API, the dashboard, Django admin's change form and a management
command each show their actor and before → after; the page filters by actor and by kind
(lists of what the log holds, kept in the URL), and a live event by a new actor or of a new
kind joins those lists. Screenshot: /tmp/audit-events-filtered.png."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from playwright.sync_api import Browser, Page, expect

from tests.support.browser import ARTIFACTS, LIVE_TIMEOUT_MS, follow, logged_in_page, screenshot
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]
SHOT = Path("/tmp/audit-events-filtered.png")
BROWSER_KEY = "wk-typed-in-the-browser-7c"
COMMAND = "manage.py create_api_key"


@pytest.fixture
def operator(router: RouterServer, browser: Browser) -> Iterator[Page]:
    page = logged_in_page(browser, router.url)
    # Django admin's change forms need the model permissions a superuser has.
    get_user_model().objects.filter(username="operator").update(is_superuser=True)
    yield page
    page.context.close()


def options(page: Page, name: str) -> list[str]:
    values = page.locator(f"form.event-filters select[name={name}] option").evaluate_all(
        "options => options.map(o => o.value)"
    )
    return [str(v) for v in values]


def row_actors(page: Page) -> list[str]:
    actors = page.locator("#event-rows li[data-event-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.actor)"
    )
    return [str(a) for a in actors]


def patch_worker(router: RouterServer, worker_id: int, **body: object) -> None:
    answer = httpx.patch(f"{router.url}/api/workers/{worker_id}", json=body, headers=ADMIN_HEADERS)
    assert answer.status_code == 200, answer.text


def test_events_page_filters_the_audit_trail_by_actor_and_kind(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("audit-browser"), name="gpu-audit")
    # The dashboard: the worker page's key form.
    operator.goto(f"{router.url}/workers/{worker.pk}/")
    operator.get_by_test_id("api-key").fill(BROWSER_KEY)
    operator.get_by_test_id("api-key-save").click()
    expect(operator.get_by_test_id("message").first).to_contain_text("API key saved.")
    # Django admin's change form.
    operator.goto(f"{router.url}/admin/controlpanel/worker/{worker.pk}/change/")
    operator.fill("#id_weight", "4")
    operator.click("input[name=_save]")
    expect(operator.locator(".messagelist")).to_contain_text("was changed successfully")
    patch_worker(router, worker.pk, weight=2)  # the admin API again

    operator.goto(f"{router.url}/events/")
    kinds = options(operator, "kind")
    assert {"worker_joined", "worker_changed", "worker_key_changed"} <= set(kinds), kinds
    assert "gpu_warning" not in kinds and "rollout" not in kinds  # nothing of theirs yet
    assert {"admin-token", "user:operator", "admin:operator"} <= set(options(operator, "actor"))

    rows = operator.locator("#event-rows li[data-event-id]")
    operator.get_by_test_id("filter-actor").select_option("admin:operator")
    follow(operator, "filter-apply")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("weight 1.0 → 4.0")
    expect(rows.first.get_by_test_id("event-actor")).to_have_text("by admin:operator")
    assert "actor=admin%3Aoperator" in operator.url

    operator.get_by_test_id("filter-actor").select_option("")
    operator.get_by_test_id("filter-kind").select_option("worker_changed")
    follow(operator, "filter-apply")
    expect(rows).to_have_count(2)
    assert row_actors(operator) == ["admin-token", "admin:operator"]
    expect(rows.first).to_contain_text("weight 4.0 → 2.0")
    assert "kind=worker_changed" in operator.url

    # Live, with the page's filters: a rename through the API arrives; a drain does not.
    expect(operator.get_by_test_id("live-status")).to_have_text("Live")
    patch_worker(router, worker.pk, name="gpu-audit-2")
    assert router.post(f"/api/workers/{worker.pk}/drain?force=1", headers=ADMIN_HEADERS).is_success
    expect(rows).to_have_count(3, timeout=LIVE_TIMEOUT_MS)
    expect(rows.first).to_contain_text("name gpu-audit → gpu-audit-2")
    expect(operator.get_by_test_id("filter-kind")).to_have_value("worker_changed")
    SHOT.parent.mkdir(exist_ok=True)
    screenshot(operator, SHOT.name)
    shutil.copy(ARTIFACTS / SHOT.name, SHOT)

    # Live, unfiltered: a command's key, a new actor and a new kind, joins both lists.
    operator.goto(f"{router.url}/events/")
    expect(operator.get_by_test_id("live-status")).to_have_text("Live")
    assert COMMAND not in options(operator, "actor")
    assert "api_key_created" not in options(operator, "kind")
    secret = StringIO()
    call_command("create_api_key", "ci-bot", "--rpm", "9", stdout=secret, stderr=StringIO())
    created = operator.locator("#event-rows li[data-kind=api_key_created]")
    expect(created).to_have_count(1, timeout=LIVE_TIMEOUT_MS)
    expect(created).to_contain_text("rpm 9")
    assert COMMAND in options(operator, "actor")
    assert "api_key_created" in options(operator, "kind")
    operator.get_by_test_id("filter-actor").select_option(COMMAND)
    follow(operator, "filter-apply")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-kind", "api_key_created")

    operator.set_viewport_size({"width": 1024, "height": 800})
    operator.goto(f"{router.url}/events/")
    expect(operator.get_by_test_id("event-changes").first).to_be_visible()
    screenshot(operator, "audit-events-all.png")
    sideways = "document.documentElement.scrollWidth - document.documentElement.clientWidth"
    assert operator.evaluate(sideways) <= 0  # the change lines wrap, never widen the page
    text = operator.locator("main").inner_text()
    assert BROWSER_KEY not in text and secret.getvalue().strip() not in text
    assert "api_key not set → set" in text  # the dashboard's key, masked
