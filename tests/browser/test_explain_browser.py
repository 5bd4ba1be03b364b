"""The models page's recent decisions (with an explanation) and pool preflight, and the
worker page's differences with the accept button, in real headless Chromium."""

from __future__ import annotations

import threading

import httpx
import pytest
from playwright.sync_api import Browser, expect

from controlpanel.fleet import health, services
from controlpanel.registry.models import Worker
from tests.support.browser import ARTIFACTS, logged_in_page
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import RouterServer, StartSimulator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_an_operator_sees_why_requests_went_where_and_how_a_worker_differs(
    browser: Browser,
    router: RouterServer,
    simulator: StartSimulator,
) -> None:
    sims = [simulator("xm"), simulator("xm"), simulator("xm", block_size=32, version="0.11.1")]
    workers = [
        services.worker_add(url=s.url, name=f"gpu-{i}", actor="t") for i, s in enumerate(sims)
    ]
    router.wait_routable(*workers)
    # The cache configuration, as the probes read it; on a thread of its own, since
    # Playwright keeps an event loop on this one and the probe round runs its own.
    probe = threading.Thread(target=health.workers_probe)
    probe.start()
    probe.join()
    body = {"model": "xm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for i in range(6):
        headers = {"X-Route-Explain": "1"} if i == 5 else {}
        assert (
            httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=headers).status_code
            == 200
        )
    refuse = httpx.patch(
        f"{router.url}/api/models/xm", json={"preflight": "refuse"}, headers=ADMIN_HEADERS
    )
    assert refuse.status_code == 200

    page = logged_in_page(browser, router.url)
    page.goto(f"{router.url}/models/")
    card = page.locator("#model-xm")
    differences = card.get_by_test_id("preflight-differences")
    expect(differences).to_contain_text(
        "gpu-2 differs from the pool: version 0.11.1 vs pool sim; block_size 32 vs pool 16"
    )
    expect(differences).to_contain_text("kept out of rotation")
    expect(card).to_contain_text("2/3 workers take traffic")
    decisions = card.get_by_test_id("recent-decisions")
    expect(decisions).to_contain_text("Recent decisions (6")
    expect(decisions.locator("tbody tr")).to_have_count(6)
    decisions.locator("tbody tr").first.locator("details summary").click()  # the explained one
    expect(decisions.locator("ol.candidates li")).to_have_count(3)
    page.screenshot(path=str(ARTIFACTS / "models-decisions-preflight.png"), full_page=True)

    odd = Worker.objects.get(name="gpu-2")
    page.goto(f"{router.url}/workers/{odd.pk}/")
    listed = page.get_by_test_id("worker-preflight")
    expect(listed).to_contain_text("xm: version 0.11.1 vs pool sim; block_size 32 vs pool 16")
    expect(listed).to_contain_text("kept out of xm's rotation")
    page.screenshot(path=str(ARTIFACTS / "worker-preflight.png"), full_page=True)
    page.get_by_test_id("preflight-accept").click()
    expect(page.get_by_test_id("worker-preflight")).to_contain_text("accepted")
    odd.refresh_from_db()
    assert odd.preflight_accepted
    page.context.close()
