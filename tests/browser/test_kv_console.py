"""The worker page shows each worker's KV events stream as every live router sees it, and
lets an operator set the endpoints, in real headless Chromium against the real server: a
simulated vLLM publishing over real ZeroMQ, the session's router subscribing and reporting.
Screenshots in test-artifacts/ (kv-*.png)."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Page, expect

from controlpanel.fleet import services
from controlpanel.registry.models import Worker
from controlpanel.routers.reports import worker_kv_streams
from tests.support.browser import screenshot
from tests.support.servers import RouterServer, StartSimulator, free_port, free_ports, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def stream_shown(worker: Worker, **expected: object) -> bool:
    """Every live router reports the worker's stream with these values."""
    rows = worker_kv_streams(worker_id=worker.pk)
    return bool(rows) and all(all(r.get(k) == v for k, v in expected.items()) for r in rows)


def test_the_worker_page_shows_the_kv_stream_and_sets_its_endpoints(
    operator: Page, router: RouterServer, simulator: StartSimulator
) -> None:
    port, replay = free_ports(2)
    sim = simulator(
        "kv-page", block_size=4, cache_blocks=8, kv_events_port=port, kv_events_replay_port=replay
    )
    worker = services.worker_add(
        url=sim.url, name="gpu-kv", actor="test",
        kv_events=f"tcp://127.0.0.1:{port}", kv_events_replay=f"tcp://127.0.0.1:{replay}",
    )  # fmt: skip
    router.wait_routable(worker)
    body = {"model": "kv-page", "messages": [{"role": "user", "content": "one two " * 20}]}
    assert httpx.post(f"{router.url}/v1/chat/completions", json=body).status_code == 200
    wait_until(lambda: stream_shown(worker, connected=True, trust="ready") and
               (worker_kv_streams(worker_id=worker.pk)[0]["blocks"] or 0) > 0)  # fmt: skip

    operator.set_viewport_size({"width": 1024, "height": 900})
    operator.goto(f"{router.url}/workers/{worker.pk}/#kv-events")
    rows = operator.locator("[data-testid=kv-stream-row]")
    expect(rows.first).to_contain_text("connected")
    expect(rows.first.locator("[data-testid=kv-trust]")).to_have_text("trusted")
    expect(operator.locator("[data-testid=kv-endpoints]")).to_contain_text(f"127.0.0.1:{port}")
    screenshot(operator, "kv-worker-stream-1024.png")

    # A wrong endpoint is refused with the reason, and what was typed stays in the form.
    operator.fill("[data-testid=kv-events]", "http://127.0.0.1:5557")
    operator.click("[data-testid=kv-events-save]")
    expect(operator.locator(".messages")).to_contain_text("KV events endpoints not changed")
    expect(operator.locator("[data-testid=kv-events]")).to_have_value("http://127.0.0.1:5557")
    assert Worker.objects.get(pk=worker.pk).kv_events == f"tcp://127.0.0.1:{port}"

    # Clearing both: the routers drop the stream, and the page says how the worker is scored.
    operator.fill("[data-testid=kv-events]", "")
    operator.fill("[data-testid=kv-events-replay]", "")
    operator.click("[data-testid=kv-events-save]")
    expect(operator.locator(".messages")).to_contain_text("KV events endpoints removed")
    expect(operator.locator("[data-testid=kv-endpoints]")).to_contain_text("No KV events endpoint")
    wait_until(lambda: not worker_kv_streams(worker_id=worker.pk))
    screenshot(operator, "kv-worker-no-stream-1024.png")


def test_a_worker_added_in_the_browser_with_its_kv_endpoint_is_subscribed(
    operator: Page, router: RouterServer, simulator: StartSimulator
) -> None:
    port = free_port()
    sim = simulator("kv-add", block_size=4, cache_blocks=8, kv_events_port=port)
    operator.goto(f"{router.url}/")
    operator.fill("[data-testid=add-url]", sim.url)
    operator.fill("[data-testid=add-kv-events]", f"tcp://127.0.0.1:{port}")
    operator.click("[data-testid=add]")
    expect(operator.locator(".messages")).to_contain_text("Added")
    worker = Worker.objects.get(url=sim.url)
    assert worker.kv_events == f"tcp://127.0.0.1:{port}"
    wait_until(lambda: stream_shown(worker, connected=True))
    # A refused endpoint keeps the whole form as typed.
    operator.fill("[data-testid=add-url]", "http://127.0.0.1:9")
    operator.fill("[data-testid=add-kv-events]", "udp://nowhere")
    operator.click("[data-testid=add]")
    expect(operator.locator(".messages")).to_contain_text("Could not add")
    expect(operator.locator("[data-testid=add-kv-events]")).to_have_value("udp://nowhere")
