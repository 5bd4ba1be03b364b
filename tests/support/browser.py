"""Driving the dashboard in Debian's headless Chromium with Playwright: launching it, a
logged-in operator's page, screenshots. The fixtures (`browser`, `operator`) are in
tests/browser/conftest.py.

Screenshots land in test-artifacts/ at the repository root.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.contrib.auth import get_user_model
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.support.common import ROOT
from tests.support.servers import WAIT_CEILING_S

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
SHOTS = Path("/tmp/shots")
PASSWORD = "operator-password-123"
# A ceiling, not a wait, for what the page shows once something happened: the dashboard
# promises 1 s (a speed figure, not the tests' to time); a loaded machine takes longer.
LIVE_TIMEOUT_MS = int(WAIT_CEILING_S * 1000)


def use_the_suites_ceiling() -> None:
    """Playwright's expect() waits 5 s unless told: the suite's ceiling instead, for every
    assertion on a page that does not name its own."""
    expect.set_options(timeout=LIVE_TIMEOUT_MS)


@contextmanager
def chromium() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        raise AssertionError(f"{CHROMIUM} is missing: install Debian's chromium (make test does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        yield browser
        browser.close()


def logged_in_page(browser: Browser, base_url: str) -> Page:
    if not get_user_model().objects.filter(username="operator").exists():
        get_user_model().objects.create_user("operator", password=PASSWORD, is_staff=True)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(LIVE_TIMEOUT_MS)  # clicks, fills, waits for a URL
    page = context.new_page()
    page.goto(f"{base_url}/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base_url}/")
    expect(page.get_by_test_id("live-status")).to_have_text("Live")
    return page


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def shot(page: Page, name: str) -> None:
    """A screenshot in test-artifacts/ and in /tmp/shots/ too."""
    screenshot(page, name)
    SHOTS.mkdir(exist_ok=True)
    shutil.copy(ARTIFACTS / name, SHOTS / name)


def follow(page: Page, test_id: str) -> None:
    """Clicks a link or a GET form's button and waits for the page it loads: what is read
    straight after must come from the new page, not from the one being left."""
    with page.expect_navigation():
        page.get_by_test_id(test_id).click()
