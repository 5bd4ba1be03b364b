"""The operator's dashboard in real headless Chromium (Debian's), driven by Playwright.

Screenshots land in test-artifacts/ at the repository root.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from controlpanel.fleet import services
from controlpanel.registry.models import Worker
from tests.support.browser import LIVE_TIMEOUT_MS, logged_in_page, screenshot
from tests.support.common import ROOT
from tests.support.servers import (
    AddWorker,
    RouterServer,
    StartSimulator,
    free_port,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def row(page: Page, worker_id: int) -> str:
    return f"#worker-{worker_id}"


def test_operator_logs_in_and_sees_the_fleet(
    operator: Page, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    first = add_worker(simulator("llama", loras=("sql-lora",)), name="gpu-a")
    second = add_worker(simulator("qwen"), name="gpu-b")
    for worker in (first, second):
        expect(operator.locator(row(operator, worker.pk))).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(operator.locator(f"{row(operator, first.pk)} [data-testid=state]")).to_have_text(
        "active"
    )
    expect(operator.locator("#model-totals")).to_contain_text("llama")
    expect(operator.locator("#worker-count")).to_have_text("2")
    screenshot(operator, "fleet.png")


def test_added_worker_appears_live_in_a_second_page(
    operator: Page, router: RouterServer, simulator: StartSimulator
) -> None:
    watcher = operator.context.new_page()
    watcher.goto(f"{router.url}/")
    expect(watcher.get_by_test_id("live-status")).to_have_text("Live")
    sim = simulator("mistral")
    operator.get_by_test_id("add-url").fill(sim.url)
    operator.get_by_test_id("add-name").fill("gpu-new")
    operator.get_by_test_id("add").click()
    expect(operator.get_by_test_id("message")).to_contain_text("serving mistral")
    worker = Worker.objects.get(name="gpu-new")
    expect(watcher.locator(row(watcher, worker.pk))).to_contain_text(
        "gpu-new", timeout=LIVE_TIMEOUT_MS
    )


def test_operator_adds_a_keyed_worker_and_rotates_its_key(
    operator: Page, router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("guarded", api_key="wk-browser-1")
    operator.get_by_test_id("add-url").fill(sim.url)
    operator.get_by_test_id("add-name").fill("gpu-keyed")
    operator.get_by_test_id("add").click()
    expect(operator.get_by_test_id("message")).to_contain_text("set the worker's API key")
    operator.get_by_test_id("add-url").fill(sim.url)
    operator.get_by_test_id("add-name").fill("gpu-keyed")
    operator.get_by_test_id("add-api-key").fill("wk-browser-1")
    operator.get_by_test_id("add").click()
    expect(operator.get_by_test_id("message")).to_contain_text("serving guarded")
    worker = Worker.objects.get(name="gpu-keyed")
    operator.goto(f"{router.url}/workers/{worker.pk}/")
    expect(operator.get_by_test_id("api-key-state")).to_contain_text("Set:")
    assert "wk-browser-1" not in operator.content()
    screenshot(operator, "worker-key.png")
    operator.get_by_test_id("api-key").fill("wk-browser-2")
    operator.get_by_test_id("api-key-save").click()
    expect(operator.get_by_test_id("message")).to_contain_text("API key saved.")
    assert Worker.objects.get(pk=worker.pk).api_key == "wk-browser-2"
    operator.get_by_test_id("api-key-clear").click()
    expect(operator.get_by_test_id("api-key-state")).to_contain_text("Not set.")


def test_adding_something_that_is_not_vllm_says_why(operator: Page, router: RouterServer) -> None:
    operator.get_by_test_id("add-url").fill(f"http://127.0.0.1:{free_port()}")
    operator.get_by_test_id("add").click()
    expect(operator.get_by_test_id("message")).to_contain_text("cannot reach")


def test_drain_during_a_stream_then_drained(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m", itl_ms=100)
    worker = add_worker(sim, name="gpu-drain")
    events: list[str] = []

    def stream() -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: sim.state.running == 1)
    selector = row(operator, worker.pk)
    expect(operator.locator(f"{selector} [data-testid=inflight]")).to_have_text(
        "1", timeout=LIVE_TIMEOUT_MS
    )
    # The only worker of m: the page asks first, naming the model and what is in flight.
    questions: list[str] = []
    operator.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.accept()))
    operator.locator(f"{selector} [data-testid=drain]").click()
    expect(operator.locator(f"{selector} [data-testid=state]")).to_have_text("draining")
    assert "last routable worker of m, with 1 request in flight" in questions[0]
    expect(operator.locator(f"{selector} [data-testid=inflight]")).to_have_text("1")
    streamer.join(timeout=30)
    assert events[-1] == "data: [DONE]"
    expect(operator.locator(f"{selector} [data-testid=state]")).to_have_text(
        "drained", timeout=LIVE_TIMEOUT_MS
    )
    expect(operator.locator(f"{selector} [data-testid=inflight]")).to_have_text("0")
    operator.goto(f"{router.url}/workers/{worker.pk}/")
    screenshot(operator, "worker.png")


def test_killed_worker_turns_unhealthy_live(
    operator: Page, celery_worker: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "manage.py", "simulate_vllm", "--port", str(port), "--model", "doomed"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _serving(url))
        worker = services.worker_add(url=url, name="gpu-doomed", actor="test")
        selector = row(operator, worker.pk)
        expect(operator.locator(f"{selector} [data-testid=state]")).to_have_text(
            "active", timeout=LIVE_TIMEOUT_MS
        )
        sim.send_signal(signal.SIGKILL)
        # Probes every 0.5 s, unhealthy after 3 failures: a few seconds at most.
        expect(operator.locator(f"{selector} [data-testid=state]")).to_have_text(
            "unhealthy", timeout=LIVE_TIMEOUT_MS
        )
        screenshot(operator, "fleet-unhealthy.png")
    finally:
        stop_process(sim)


def _serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_live_feed_reconnects_after_a_server_restart(browser: Browser, var_dir: Path) -> None:
    server = start_router(var_dir)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        page = logged_in_page(browser, server.url)
        stop_process(server.proc)
        expect(page.get_by_test_id("live-status")).to_have_text("Reconnecting…")
        server = start_router(var_dir, port=port)
        expect(page.get_by_test_id("live-status")).to_have_text("Live · reconnected")
        page.context.close()
    finally:
        stop_process(server.proc)
