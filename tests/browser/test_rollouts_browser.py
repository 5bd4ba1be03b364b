"""An admin plans a rollout in the browser, watches it move live, pauses and resumes it."""

from __future__ import annotations

import re
import subprocess

import pytest
from playwright.sync_api import Page, expect

from controlpanel.registry.models import Alias
from tests.support.browser import LIVE_TIMEOUT_MS, screenshot
from tests.support.servers import AddWorker, RouterServer, StartSimulator
from tests.support.traffic import SteadyTraffic

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_plan_created_in_the_browser_progresses_live(
    operator: Page,
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    celery_worker: subprocess.Popen[bytes],
) -> None:
    add_worker(simulator("chat-v1"), name="v1-gpu")
    add_worker(simulator("chat-v2"), name="v2-gpu")
    operator.goto(f"{router.url}/rollouts/")
    operator.get_by_test_id("alias-name").fill("chat")
    operator.get_by_test_id("alias-targets").fill("chat-v1=100")
    operator.get_by_test_id("alias-create").click()
    expect(operator.get_by_test_id("message")).to_contain_text("Created chat")

    with SteadyTraffic(router.url, "chat", concurrency=2):
        operator.get_by_test_id("plan-to").fill("chat-v2")
        operator.get_by_test_id("plan-steps").fill("30 4s\n100 1s")
        operator.get_by_test_id("plan-min-requests").fill("5")
        # Two workers sharing this machine's CPUs with the test: latency is too noisy to
        # gate on tightly here (tests/e2e/test_rollouts_e2e.py proves the latency gate).
        operator.get_by_test_id("plan-p95-ratio").fill("50")
        operator.get_by_test_id("plan-create").click()
        state = operator.get_by_test_id("plan-state")
        expect(state).to_have_text("running")
        expect(operator.get_by_test_id("plan-step")).to_have_text("1")

        operator.get_by_test_id("action-pause").click()
        expect(state).to_have_text("paused")
        operator.get_by_test_id("action-resume").click()
        expect(state).to_have_text("running")
        expect(operator.get_by_test_id("new-requests")).to_have_text(
            re.compile(r"^[1-9]\d* · "), timeout=LIVE_TIMEOUT_MS
        )
        screenshot(operator, "rollout-running.png")
        # From here on nobody reloads: the page moves with the plan over the websocket.
        expect(operator.get_by_test_id("plan-step")).to_have_text("2", timeout=LIVE_TIMEOUT_MS)
        expect(state).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    expect(operator.get_by_test_id("history").locator("tbody tr")).to_have_count(2)
    expect(operator.locator("ul.events li").first).to_contain_text("completed")  # live too
    screenshot(operator, "rollout-completed.png")
    assert Alias.objects.get(name="chat").targets == {"chat-v2": 100}
    operator.goto(f"{router.url}/rollouts/")
    expect(operator.locator("[data-testid=plans] [data-testid=plan-state]")).to_have_text(
        "completed"
    )
    screenshot(operator, "rollouts.png")
