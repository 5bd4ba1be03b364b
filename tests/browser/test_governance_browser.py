"""The models page in Chromium under saturation: the priority classes table makes waiting and
shed requests stand out, and a model's fallbacks say how many requests moved on."""

from __future__ import annotations

import threading

import httpx
import pytest
from playwright.sync_api import Page, expect

from controlpanel.registry.models import ServedModel
from tests.support.browser import screenshot
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_the_models_page_shows_shed_requests_and_fallbacks(
    operator: Page,
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
) -> None:
    sim = simulator("gov-busy", itl_ms=25)
    add_worker(sim)
    ServedModel.objects.create(name="gov-empty")  # no worker of its own
    for name, change in (
        ("gov-empty", {"fallbacks": ["gov-busy"]}),
        ("gov-busy", {"max_inflight": 1}),
    ):
        answer = httpx.patch(f"{router.url}/api/models/{name}", json=change, headers=ADMIN_HEADERS)
        assert answer.status_code == 200, answer.text
    router.wait_snapshot()
    body = {"model": "gov-busy", "prompt": "x", "max_tokens": 60}
    busy = threading.Thread(target=lambda: router.post("/v1/completions", json=body))
    busy.start()
    try:
        wait_until(lambda: sim.state.running == 1)
        shed = router.post(
            "/v1/completions", json={**body, "max_tokens": 1}, headers={"X-Priority": "sheddable"}
        )
        assert shed.status_code == 429
    finally:
        busy.join()
    moved = router.post("/v1/completions", json={**body, "model": "gov-empty", "max_tokens": 1})
    assert moved.status_code == 200 and moved.json()["model"] == "gov-empty"

    def reported() -> bool:  # the routers report what moved on about once a second
        operator.goto(f"{router.url}/models/")
        return operator.get_by_test_id("fallbacks-moved").count() > 0

    try:
        wait_until(reported, interval=0.5)
        for width in (1280, 1024):
            operator.set_viewport_size({"width": width, "height": 900})
            operator.goto(f"{router.url}/models/")
            card = operator.locator("#model-gov-busy")
            expect(card.get_by_test_id("priority-classes")).to_be_visible()
            shed_cell = card.locator("tr.class-sheddable td").nth(3)
            expect(shed_cell).to_have_text("1")
            expect(shed_cell).to_have_class("warn")
            empty = operator.locator("#model-gov-empty")
            expect(empty.get_by_test_id("fallbacks-moved")).to_contain_text("1 to gov-busy")
            # Not "requests get 503": they go to the fallback.
            expect(empty.get_by_test_id("no-worker")).to_contain_text("move on to its fallbacks")
            widest = operator.evaluate("document.documentElement.scrollWidth")
            assert widest <= width, f"the models page is {widest} px wide at {width}"
            card.scroll_into_view_if_needed()
            screenshot(operator, f"models-governance-{width}.png")
    finally:
        httpx.patch(
            f"{router.url}/api/models/gov-busy", json={"max_inflight": 0}, headers=ADMIN_HEADERS
        )
