"""Prefill/decode roles in the console, in real headless Chromium (Debian's) against the
session's router: the fleet table's Role column and role filter, the add form's role, and
each model's role counts on the fleet's totals and the models page. Screenshots in /tmp
(pd-roles-*.png).

The browser and the logged-in operator are the browser tier's fixtures
(tests/browser/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from controlpanel.fleet import services
from controlpanel.registry.models import Worker
from tests.support.browser import LIVE_TIMEOUT_MS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]
SHOTS = Path("/tmp")


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(SHOTS / name), full_page=True)


def fleet(router: Any, simulator: Callable[..., Any]) -> dict[str, Worker]:
    """A disaggregated model (two prefill, one decode, one both) and a plain one."""
    roles = {"pf-1": "prefill", "pf-2": "prefill", "dec-1": "decode", "mix-1": "both"}
    workers: dict[str, Worker] = {}
    for name, role in roles.items():
        sim = simulator("pd-llama")
        workers[name] = services.worker_add(url=sim.url, name=name, role=role, actor="test")
    workers["plain-1"] = services.worker_add(
        url=simulator("plain-qwen").url, name="plain-1", actor="test"
    )
    router.wait_snapshot()
    return workers


def shown_names(page: Page) -> list[str]:
    names = page.locator("#fleet-rows tr:not([hidden])").evaluate_all(
        "rows => rows.map(r => r.dataset.name)"
    )
    return sorted(str(n) for n in names)


def test_the_fleet_shows_each_role_and_filters_by_it(
    operator: Page, router: Any, simulator: Callable[..., Any]
) -> None:
    workers = fleet(router, simulator)
    operator.goto(f"{router.url}/")
    for worker in workers.values():
        cell = operator.locator(f"#worker-{worker.pk} [data-testid=role]")
        expect(cell).to_have_text(worker.role)
    header = operator.locator("#fleet-table thead th", has_text="Role")
    expect(header).to_have_count(1)

    role = operator.get_by_test_id("filter-role")
    role.select_option("prefill")
    assert shown_names(operator) == ["pf-1", "pf-2"]
    shot(operator, "pd-roles-fleet-prefill.png")
    role.select_option("decode")
    assert shown_names(operator) == ["dec-1"]
    role.select_option("both")
    assert shown_names(operator) == ["mix-1", "plain-1"]
    # With the model filter too: both filters hold at once.
    operator.get_by_test_id("filter-model").select_option("pd-llama")
    assert shown_names(operator) == ["mix-1"]
    role.select_option("")
    assert shown_names(operator) == ["dec-1", "mix-1", "pf-1", "pf-2"]
    operator.get_by_test_id("filter-model").select_option("")
    assert len(shown_names(operator)) == 5

    # A role changed elsewhere reaches the open page live, and the filter still applies.
    role.select_option("decode")
    services.worker_update(worker_id=workers["mix-1"].pk, name=None, weight=None,
                           role="decode", actor="ops")  # fmt: skip
    cell = operator.locator(f"#worker-{workers['mix-1'].pk} [data-testid=role]")
    expect(cell).to_have_text("decode", timeout=LIVE_TIMEOUT_MS)
    expect(operator.locator(f"#worker-{workers['mix-1'].pk}")).to_be_visible()
    assert shown_names(operator) == ["dec-1", "mix-1"]


def test_each_model_shows_its_role_counts(
    operator: Page, router: Any, simulator: Callable[..., Any]
) -> None:
    fleet(router, simulator)
    operator.goto(f"{router.url}/")
    totals = operator.locator("#model-totals")
    counts = totals.locator("[data-model=pd-llama] [data-testid=role-counts]")
    expect(counts).to_have_text("2 prefill · 1 decode · 1 both")
    expect(totals.locator("[data-model=plain-qwen] [data-testid=role-counts]")).to_have_count(0)
    shot(operator, "pd-roles-fleet.png")

    operator.goto(f"{router.url}/models/")
    card = operator.locator("#model-pd-llama")
    expect(card.get_by_test_id("role-counts")).to_contain_text("2 prefill · 1 decode · 1 both")
    expect(card.get_by_test_id("role-counts")).to_contain_text("prompts under 256 uncached")
    expect(operator.locator("#model-plain-qwen").get_by_test_id("role-counts")).to_have_count(0)
    shot(operator, "pd-roles-models.png")


def test_the_add_form_sets_the_role_and_keeps_it_when_refused(
    operator: Page, router: Any, simulator: Callable[..., Any]
) -> None:
    sim = simulator("pd-added")
    operator.goto(f"{router.url}/")
    form_role = operator.get_by_test_id("add-role")
    expect(form_role).to_have_value("both")
    assert form_role.locator("option").all_inner_texts() == ["prefill", "decode", "both"]
    operator.get_by_test_id("add-url").fill(sim.url)
    operator.get_by_test_id("add-name").fill("gpu-decode")
    form_role.select_option("decode")
    with operator.expect_navigation():
        operator.get_by_test_id("add").click()
    worker = Worker.objects.get(url=sim.url)
    assert worker.role == "decode"
    expect(operator.locator("main")).to_contain_text("Role: decode.")
    expect(operator.locator(f"#worker-{worker.pk} [data-testid=role]")).to_have_text("decode")

    # A refused add (the URL is taken) gives the form back with the role that was chosen.
    operator.get_by_test_id("add-url").fill(sim.url)
    operator.get_by_test_id("add-role").select_option("prefill")
    with operator.expect_navigation():
        operator.get_by_test_id("add").click()
    expect(operator.locator("main")).to_contain_text("already registered")
    expect(operator.get_by_test_id("add-role")).to_have_value("prefill")
    assert Worker.objects.get(url=sim.url).role == "decode"
    shot(operator, "pd-roles-add.png")
