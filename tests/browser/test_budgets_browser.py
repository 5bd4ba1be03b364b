"""The keys page and token budgets, in a real browser: an admin makes a key with a class,
a weight and budgets (a typo keeps what was typed), sees what the key spends against them,
and changes its budget from the page."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.support import keyed
from tests.support.browser import screenshot
from tests.support.keyed import add_keyed_worker, issue, openai_client
from tests.support.servers import RouterServer, StartSimulator, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_a_key_with_budgets_is_made_shown_with_its_spend_and_edited(
    operator: Page,
    router: RouterServer,
    keyed_router: RouterServer,
    simulator: StartSimulator,
) -> None:
    add_keyed_worker(keyed_router, simulator("m"), issue(keyed_router, "ops"))
    operator.goto(f"{router.url}/keys/")
    operator.get_by_test_id("key-name").fill("batch-team")
    operator.get_by_test_id("key-priority").select_option("sheddable")
    operator.get_by_test_id("key-weight").fill("3")
    operator.get_by_test_id("key-daily-tokens").fill("60k")
    operator.get_by_test_id("key-monthly-tokens").fill("5000")
    operator.get_by_test_id("key-create").click()
    expect(operator.get_by_test_id("message")).to_contain_text("whole numbers, not '60k'")
    # What was typed comes back, to be fixed rather than typed again.
    expect(operator.get_by_test_id("key-name")).to_have_value("batch-team")
    expect(operator.get_by_test_id("key-priority")).to_have_value("sheddable")
    expect(operator.get_by_test_id("key-weight")).to_have_value("3")
    expect(operator.get_by_test_id("key-daily-tokens")).to_have_value("60k")
    expect(operator.get_by_test_id("key-monthly-tokens")).to_have_value("5000")

    operator.get_by_test_id("key-daily-tokens").fill("60")
    operator.get_by_test_id("key-create").click()
    secret = operator.get_by_test_id("issued-key").inner_text().strip()
    row = operator.locator("[data-testid=keys] tbody tr", has_text="batch-team")
    expect(row.get_by_test_id("key-class")).to_have_text("sheddable")
    expect(row.get_by_test_id("key-row-weight")).to_have_text("3")
    expect(row.get_by_test_id("key-daily")).to_contain_text("0 / 60")
    expect(row.get_by_test_id("key-daily-left")).to_have_text("60")
    expect(row.get_by_test_id("key-monthly")).to_contain_text("0 / 5000")
    expect(row.get_by_test_id("key-daily")).to_contain_text("resets")

    wait_until(lambda: keyed_router.get("/v1/models", headers=keyed.bearer(secret)).is_success)
    answer = openai_client(keyed_router, secret).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=4
    )
    assert answer.usage is not None
    spent = answer.usage.total_tokens

    def page_shows_the_spend() -> bool:
        operator.goto(f"{router.url}/keys/")
        return row.get_by_test_id("key-daily-used").inner_text() == str(spent)

    wait_until(page_shows_the_spend, interval=0.5)  # usage rows: ~2 s per router
    expect(row.get_by_test_id("key-daily-left")).to_have_text(str(60 - spent))
    expect(row.get_by_test_id("key-monthly-used")).to_have_text(str(spent))
    screenshot(operator, "keys-budgets.png")

    row.get_by_test_id("key-edit").click()
    expect(row.get_by_test_id("edit-priority")).to_have_value("sheddable")
    row.get_by_test_id("edit-daily-tokens").fill(str(spent))
    row.get_by_test_id("edit-priority").select_option("critical")
    row.get_by_test_id("edit-save").click()
    expect(operator.get_by_test_id("message")).to_contain_text("is saved")
    expect(row.get_by_test_id("key-class")).to_have_text("critical")
    expect(row.get_by_test_id("key-daily")).to_contain_text(f"{spent} / {spent}")
    expect(row.get_by_test_id("key-daily")).to_contain_text("used up")
    screenshot(operator, "keys-budget-edited.png")
