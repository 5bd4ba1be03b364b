"""GPU strips in real headless Chromium: the Celery probe scrapes a simulated DCGM exporter
and the fleet row's strip changes live; a lost GPU shows a warning. Screenshots land in
test-artifacts/ (fleet-gpus.png, worker-gpus.png)."""

from __future__ import annotations

import re
import subprocess
import threading

import httpx
import pytest
from playwright.sync_api import Page, expect

from controlpanel.fleet import services
from tests.support.browser import screenshot
from tests.support.servers import WAIT_CEILING_S, RouterServer, StartSimulator, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]
PROBED_MS = int(WAIT_CEILING_S * 1000)  # probes every 0.5 s; a ceiling for a loaded machine


def busy(url: str, stop: threading.Event) -> None:
    """Some traffic, so the simulated GPUs have work to show."""
    body = {"model": "llama", "prompt": "hello " * 40, "max_tokens": 40}
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            client.post(f"{url}/v1/completions", json=body)


def test_gpu_strip_updates_live_and_warns(
    operator: Page,
    router: RouterServer,
    simulator: StartSimulator,
    celery_worker: subprocess.Popen[bytes],
) -> None:
    sim = simulator("llama", gpus=2, itl_ms=20, max_batch=4)
    services.worker_add(url=simulator("qwen").url, name="cpu-box", actor="test")
    worker = services.worker_add(
        url=sim.url, name="gpu-box", dcgm_url=f"{sim.url}/dcgm-metrics", actor="test"
    )
    stop = threading.Event()
    traffic = [threading.Thread(target=busy, args=(sim.url, stop)) for _ in range(3)]
    for thread in traffic:
        thread.start()
    try:
        row = operator.locator(f"#worker-{worker.pk}")
        cells = row.locator("[data-testid=gpus] .gpu")
        expect(cells).to_have_count(2, timeout=PROBED_MS)
        expect(cells.first).to_have_attribute("title", re.compile(r".+"), timeout=PROBED_MS)
        first = cells.first.get_attribute("title") or ""
        assert first.startswith("GPU 0 · NVIDIA H100 80GB HBM3") and "°C" in first
        # Each probe reads new values; the row is re-rendered in place with them.
        expect(cells.first).not_to_have_attribute("title", first, timeout=PROBED_MS)
        expect(operator.locator("tr:has-text('cpu-box') [data-testid=gpus]")).to_have_text(
            "unknown"
        )
        # Some history for the worker page's charts: 8 probes' GPU readings (4 s or more).
        wait_until(lambda: worker.samples.filter(gpus__isnull=False).count() >= 8)
        screenshot(operator, "fleet-gpus.png")

        httpx.post(f"{sim.url}/sim/control", json={"gpu_count": 1}, timeout=5)
        expect(cells).to_have_count(1, timeout=PROBED_MS)
        expect(row.get_by_test_id("gpu-warning")).to_be_visible()
        expect(row).to_contain_text("1 of 2 GPUs report")

        operator.goto(f"{router.url}/workers/{worker.pk}/")
        expect(operator.get_by_test_id("gpu-chart")).to_have_count(2)
        expect(operator.get_by_test_id("gpu-warnings")).to_contain_text("fallen off the bus")
        screenshot(operator, "worker-gpus.png")
    finally:
        stop.set()
        for thread in traffic:
            thread.join(timeout=30)
