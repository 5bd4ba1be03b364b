"""/api/docs renders in real headless Chromium with no network beyond the server itself."""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser, Route

from tests.support.browser import LIVE_TIMEOUT_MS
from tests.support.servers import RouterServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_api_docs_render_with_the_network_blocked(router: RouterServer, browser: Browser) -> None:
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
    page.wait_for_selector(".swagger-ui .opblock", timeout=LIVE_TIMEOUT_MS)
    assert page.locator(".swagger-ui .opblock").count() > 10
    page.screenshot(path="test-artifacts/api-docs-offline.png", full_page=False)
    page.close()
    assert elsewhere == [], elsewhere
