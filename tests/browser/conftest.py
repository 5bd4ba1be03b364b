"""The browser tier's fixtures: Debian's headless Chromium, once per module, and a staff
operator's page logged in to the session's router. What the tests do with them is in
tests.support.browser."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page

from tests.support.browser import chromium, logged_in_page, use_the_suites_ceiling
from tests.support.servers import RouterServer

use_the_suites_ceiling()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium, driven by Playwright (tests.support.browser)."""
    # Playwright's sync API keeps an event loop on this thread; the tests' own ORM calls
    # are still plain synchronous code, which Django must be told to allow.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with chromium() as launched:
            yield launched
    finally:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]


@pytest.fixture
def operator(router: RouterServer, browser: Browser) -> Iterator[Page]:
    """A staff operator's page, logged in to the session's router."""
    page = logged_in_page(browser, router.url)
    yield page
    page.context.close()
