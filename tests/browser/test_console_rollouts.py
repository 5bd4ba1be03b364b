"""The rollouts pages say what really happened, in real headless Chromium: a plan its gate
rolled back reads "rolled back" (never the raw `rolled_back`) and names the gate that
failed, an action's flash message says the state the plan is in after it, and a click is
not lost to the live feed replacing the panel under it. A real
Celery worker with beat moves the plan; steady traffic through the alias feeds the gates."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, WebSocketRoute, expect

from tests.support.browser import shot
from tests.support.rollouts import create_alias, create_plan, wait_for_state
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until
from tests.support.traffic import SteadyTraffic

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def test_a_rolled_back_plan_names_its_failed_gate_and_flashes_say_the_state(
    operator: Page,
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    celery_worker: subprocess.Popen[bytes],
) -> None:
    add_worker(simulator("chat-v1"), name="v1-gpu")
    failing = simulator("chat-v2")
    add_worker(failing, name="v2-gpu")
    # Enough failures for the error-rate gate (5%), too few for the worker to turn degraded
    # (50%), which would fail the plan on "no healthy worker" instead.
    assert httpx.post(failing.url + "/sim/control", json={"fail_ratio": 0.25}).status_code == 200
    create_alias(router, "chat", {"chat-v1": 100})
    with SteadyTraffic(router.url, "chat", concurrency=2):
        plan = create_plan(
            router, alias="chat", to_target="chat-v2",
            steps=[{"weight": 50, "hold_seconds": 60}, {"weight": 100, "hold_seconds": 60}],
            gates={"max_error_rate": 0.05, "max_ttft_p95_ratio": 50, "min_requests": 10},
        )  # fmt: skip
        wait_for_state(router, plan["id"], {"rolled_back"})
    operator.goto(f"{router.url}/rollouts/")
    row = operator.locator(f"#rollout-row-{plan['id']}")
    expect(row.get_by_test_id("plan-state")).to_have_text("rolled back")
    expect(row.get_by_test_id("failed-gate")).to_contain_text("gate failed:")
    expect(row.get_by_test_id("failed-gate")).to_contain_text("error rate")
    shot(operator, "console-rollout-rolled-back.png")
    operator.set_viewport_size({"width": 1024, "height": 800})
    wide = operator.evaluate(
        "[...document.querySelectorAll('main *')]"
        ".filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth)"
        ".map(e => e.tagName + '.' + e.className)"
    )
    assert not wide, wide  # nothing sticks out of the page at 1024 px, in a table or not
    shot(operator, "console-rollout-rolled-back-1024.png")
    operator.set_viewport_size({"width": 1280, "height": 800})

    # A healthy plan this time: each action's flash says where the plan is now.
    assert httpx.post(failing.url + "/sim/control", json={"fail_ratio": 0}).status_code == 200
    second = running_healthy_plan(router)
    operator.goto(f"{router.url}/rollouts/{second['id']}/")
    operator.get_by_test_id("action-pause").click()
    flash = operator.get_by_test_id("message")
    expect(flash).to_have_text(f"Rollout #{second['id']} is paused.")
    expect(operator.get_by_test_id("plan-state")).to_have_text("paused")
    operator.once("dialog", lambda dialog: dialog.accept())  # "Send all of chat's traffic back?"
    operator.get_by_test_id("action-rollback").click()
    expect(flash).to_have_text(re.compile(rf"^Rollout #{second['id']} is (rolling|rolled) back\b"))
    expect(operator.get_by_test_id("plan-state")).to_have_text(
        re.compile("^(rolling|rolled) back$")
    )
    assert "rolled_back" not in operator.locator("main").inner_text().replace("rollout", "")
    shot(operator, "console-rollout-flash.png")


def test_a_pressed_button_keeps_its_click_when_the_live_feed_replaces_its_panel(
    operator: Page,
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    celery_worker: subprocess.Popen[bytes],
) -> None:
    """The feed's first message (everything, on connect) replaced the plan's panel between
    a click's mousedown and mouseup on a loaded machine, and the click was lost. The feed
    is held here (route_web_socket) and let through while the button is pressed."""
    add_worker(simulator("chat-v1"), name="v1-gpu")
    add_worker(simulator("chat-v2"), name="v2-gpu")
    create_alias(router, "chat", {"chat-v1": 100})
    plan = running_healthy_plan(router)
    from_server: list[str | bytes] = []
    feeds: list[WebSocketRoute] = []

    def hold_the_feed(feed: WebSocketRoute) -> None:
        feeds.append(feed)
        feed.connect_to_server().on_message(lambda message: from_server.append(message))

    operator.route_web_socket(re.compile(r"/ws/fleet/$"), hold_the_feed)
    operator.goto(f"{router.url}/rollouts/{plan['id']}/")
    until(operator, lambda: bool(feeds and from_server))  # the full message, held
    pause = operator.get_by_test_id("action-pause").bounding_box()
    assert pause is not None
    operator.mouse.move(pause["x"] + pause["width"] / 2, pause["y"] + pause["height"] / 2)
    operator.mouse.down()
    feeds[0].send(from_server[0])  # the plan's panel, rendered anew, arrives mid-click
    expect(operator.get_by_test_id("live-status")).to_have_attribute("data-held", "1")
    operator.mouse.up()
    expect(operator.get_by_test_id("message")).to_have_text(f"Rollout #{plan['id']} is paused.")
    expect(operator.get_by_test_id("plan-state")).to_have_text("paused")
    shot(operator, "console-rollout-paused-mid-update.png")


def running_healthy_plan(router: RouterServer) -> dict[str, Any]:
    """A plan from chat-v1 to chat-v2 whose gates pass, holding its first step for minutes
    (the alias exists), once Celery has started it."""
    plan = create_plan(
        router, alias="chat", to_target="chat-v2",
        steps=[{"weight": 20, "hold_seconds": 300}, {"weight": 100, "hold_seconds": 300}],
        gates={"max_error_rate": 1, "max_ttft_p95_ratio": 50, "min_requests": 1},
    )  # fmt: skip
    wait_for_state(router, plan["id"], {"running"})
    return plan


def until(page: Page, condition: Callable[[], bool]) -> None:
    """wait_until for a condition that Playwright's callbacks make true: they run only while
    the page is waited on, never during wait_until's plain sleep."""

    def after_a_wait_on_the_page() -> bool:
        page.wait_for_timeout(50)
        return condition()

    wait_until(after_a_wait_on_the_page, interval=0)
