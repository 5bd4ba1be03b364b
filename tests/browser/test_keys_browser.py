"""An admin makes a client key in the browser, sees it once, a client uses it through a
router that requires keys, the usage page shows what it spent, and the admin revokes it."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.support import keyed
from tests.support.browser import screenshot
from tests.support.keyed import add_keyed_worker, issue, openai_client
from tests.support.servers import RouterServer, StartSimulator, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_key_made_in_the_browser_is_shown_once_used_metered_and_revoked(
    operator: Page,
    router: RouterServer,
    keyed_router: RouterServer,
    simulator: StartSimulator,
) -> None:
    add_keyed_worker(keyed_router, simulator("m"), issue(keyed_router, "ops"))
    operator.goto(f"{router.url}/keys/")
    operator.get_by_test_id("key-name").fill("search-team")
    operator.get_by_test_id("key-models").fill("m")
    operator.get_by_test_id("key-rpm").fill("120")
    operator.get_by_test_id("key-create").click()
    secret = operator.get_by_test_id("issued-key").inner_text().strip()
    assert secret.startswith("cpk_")
    screenshot(operator, "keys-created.png")

    client = openai_client(keyed_router, secret)
    wait_until(lambda: keyed_router.get("/v1/models", headers=keyed.bearer(secret)).is_success)
    for tokens in (3, 5):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=tokens
        )

    def usage_row_shows_two_requests() -> bool:
        operator.goto(f"{router.url}/usage/")
        row = operator.locator("[data-testid=usage] tbody tr", has_text="search-team")
        return row.count() == 1 and row.get_by_test_id("requests").inner_text() == "2"

    wait_until(usage_row_shows_two_requests, interval=0.5)
    row = operator.locator("[data-testid=usage] tbody tr", has_text="search-team")
    expect(row.get_by_test_id("completion")).to_have_text("8")
    screenshot(operator, "usage.png")

    operator.goto(f"{router.url}/keys/")
    expect(operator.get_by_test_id("issued")).to_have_count(0)  # never shown again
    assert secret not in operator.content()
    key_row = operator.locator("[data-testid=keys] tbody tr", has_text="search-team")
    operator.once("dialog", lambda dialog: dialog.accept())
    key_row.get_by_test_id("key-revoke").click()
    expect(operator.get_by_test_id("message")).to_contain_text("is revoked")
    expect(key_row.get_by_test_id("key-state")).to_have_text("revoked")
    screenshot(operator, "keys-revoked.png")
    wait_until(
        lambda: keyed_router.get("/v1/models", headers=keyed.bearer(secret)).status_code == 401
    )
