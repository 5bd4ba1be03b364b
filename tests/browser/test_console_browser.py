"""The worker page's charts and the events page, in real headless Chromium at 1280 and 1024
px, against the real server: axes, time labels, a hover readout and 15 min / 1 h / 6 h
ranges; the event log filtered by kind, severity, worker, actor, time and text, coloured by
severity, and live. Screenshots in /tmp/shots/ and test-artifacts/ (console-*.png)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from controlpanel.registry.events import event_record
from controlpanel.registry.models import Event, Worker, WorkerSample
from tests.support.browser import (
    LIVE_TIMEOUT_MS,
    follow,
    shot,
)
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]
ONE_FORMAT = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")
# What reaches past the right edge of the window: inside a scrolling table or not, an
# operator would have to scroll sideways to see it.
STICKING_OUT = """[...document.querySelectorAll('main *')]
  .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 0.5)
  .map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))"""


def _history(worker: Worker, *, minutes: int, end_ago: float = 0.0, queue: int = 3) -> None:
    """Probe history as the probes write it, one sample every 5 s: running 2 and waiting
    queue - 2, 40% KV cache, 80 ms TTFT, 1.5 requests per second."""
    now = timezone.now()
    samples = [
        WorkerSample(worker=worker, at=now - timedelta(seconds=end_ago + 5 * i), up=True,
                     running=2, waiting=queue - 2, kv_cache_usage=0.4, ttft_p50=0.08, rps=1.5)
        for i in range(minutes * 12)
    ]  # fmt: skip
    WorkerSample.objects.bulk_create(samples)


def test_worker_charts_have_axes_times_hover_values_and_ranges(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("llama-3.1-8b-instruct"), name="gpu-charts")
    _history(worker, minutes=14, queue=3)
    _history(worker, minutes=60, end_ago=3 * 3600, queue=7)  # only the 6 h range reaches it
    for width in (1280, 1024):
        operator.set_viewport_size({"width": width, "height": 900})
        operator.goto(f"{router.url}/workers/{worker.pk}/")
        charts = operator.locator("figure[data-testid=chart]")
        expect(charts).to_have_count(4)
        queue = charts.first
        expect(queue.locator("figcaption")).to_contain_text("last 15 minutes · times in UTC")
        ticks = queue.locator("text.xtick").all_text_contents()
        assert len(ticks) >= 4 and all(re.fullmatch(r"\d\d:\d\d", t) for t in ticks), ticks
        assert queue.locator("text.ytick").all_text_contents()[0] == "0"
        # The drawing uses its whole box: the SVG is as wide as the figure's content.
        svg, figure = queue.locator("svg").bounding_box(), queue.bounding_box()
        assert svg and figure and svg["width"] >= figure["width"] - 24, (svg, figure)
        line = queue.locator("polyline").bounding_box()
        assert line and line["width"] >= svg["width"] * 0.75, (line, svg)
        operator.mouse.move(svg["x"] + svg["width"] * 0.6, svg["y"] + svg["height"] / 2)
        readout = queue.get_by_test_id("chart-readout")
        expect(readout).to_be_visible()
        expect(readout).to_contain_text("queue: 3 requests")
        assert ONE_FORMAT.match(readout.locator("b").inner_text())
        kv = charts.nth(1)
        box = kv.locator("svg").bounding_box()
        assert box
        operator.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2)
        expect(kv.get_by_test_id("chart-readout")).to_contain_text("KV cache: 40%")
        shot(operator, f"console-worker-charts-{width}.png")
    operator.get_by_test_id("range-6h").click()
    expect(operator.get_by_test_id("chart-ranges")).to_contain_text("6 h")
    queue = operator.locator("figure[data-testid=chart]").first
    expect(queue.locator("figcaption")).to_contain_text("last 6 hours")
    # Two runs of history, three hours apart: two separate lines, not one bridged.
    expect(queue.locator("polyline")).to_have_count(2)
    assert "7.5" in queue.locator("text.ytick").all_text_contents()  # the older queue of 7
    shot(operator, "console-worker-charts-6h.png")
    operator.goto(f"{router.url}/workers/{worker.pk}/?range=1h")
    expect(operator.locator("figure[data-testid=chart]").first).to_contain_text("last 1 hour")
    operator.goto(f"{router.url}/workers/{worker.pk}/?range=bogus")
    expect(operator.locator("figure[data-testid=chart]").first).to_contain_text("15 minutes")


def test_worker_page_labels_and_times(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("qwen-2.5-7b"), name="gpu-labels")
    operator.goto(f"{router.url}/workers/{worker.pk}/")
    expect(operator.get_by_test_id("api-key-state")).to_contain_text("Not set.")
    assert "None" not in operator.locator("main").inner_text()
    times = operator.locator("main time").all_inner_texts()
    assert times and all(ONE_FORMAT.match(t) for t in times), times


def _events(a: Worker, b: Worker) -> None:
    event_record(kind="worker_joined", worker=a, message="joined the fleet", actor="agent")
    event_record(kind="worker_joined", worker=b, message="joined the fleet", actor="agent")
    event_record(kind="worker_degraded", worker=a, message="12 of 20 failed", actor="router")
    event_record(kind="drain_started", worker=b, message="no new requests", actor="operator")
    event_record(kind="policy_changed", worker=None, message="llama → round_robin", actor="ops")
    old = event_record(kind="worker_unhealthy", worker=b, message="3 probes failed", actor="probe")
    Event.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=2))


def _kinds(page: Page) -> list[str]:
    kinds = page.locator("#event-rows li[data-event-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.kind)"
    )
    return [str(k) for k in kinds]


def test_events_page_filters_colours_and_goes_live(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    a = add_worker(simulator("m-a"), name="ev-a")
    b = add_worker(simulator("m-b"), name="ev-b")
    Event.objects.all().delete()  # only this test's events, in a known order
    _events(a, b)
    operator.goto(f"{router.url}/events/")
    expect(operator.get_by_test_id("live-status")).to_have_text("Live")
    rows = operator.locator("#event-rows li[data-event-id]")
    expect(rows).to_have_count(6)
    degraded = operator.locator("#event-rows li[data-kind=worker_degraded]")
    joined = operator.locator("#event-rows li[data-kind=worker_joined]").first
    expect(degraded).to_have_class(re.compile("ev-bad"))
    expect(joined).to_have_class(re.compile("ev-ok"))
    colour = "el => getComputedStyle(el).borderLeftColor"
    assert degraded.evaluate(colour) != joined.evaluate(colour)
    assert all(ONE_FORMAT.match(t) for t in operator.locator("#event-rows time").all_inner_texts())
    for width in (1280, 1024):
        operator.set_viewport_size({"width": width, "height": 800})
        shot(operator, f"console-events-{width}.png")
        overflow = operator.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, (width, overflow)

    operator.get_by_test_id("filter-kind").select_option("worker_joined")
    follow(operator, "filter-apply")
    expect(rows).to_have_count(2)
    operator.get_by_test_id("filter-worker").select_option(str(b.pk))
    follow(operator, "filter-apply")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("ev-b")
    # The filters are a link: they survive the round trip and show what was chosen.
    expect(operator.get_by_test_id("filter-kind")).to_have_value("worker_joined")
    follow(operator, "filter-clear")
    expect(rows).to_have_count(6)
    operator.get_by_test_id("filter-actor").select_option("operator")
    follow(operator, "filter-apply")
    assert _kinds(operator) == ["drain_started"]
    operator.goto(f"{router.url}/events/?since=1h")
    expect(rows).to_have_count(5)  # the unhealthy event from two days ago is out
    operator.goto(f"{router.url}/events/?severity=bad")
    assert sorted(_kinds(operator)) == ["worker_degraded", "worker_unhealthy"]
    operator.get_by_test_id("filter-q").fill("round_robin")
    operator.get_by_test_id("filter-severity").select_option("")
    follow(operator, "filter-apply")
    assert _kinds(operator) == ["policy_changed"]

    # Live, with the page's own filters: a new degraded event appears, a join does not.
    operator.goto(f"{router.url}/events/?kind=worker_degraded")
    expect(operator.get_by_test_id("live-status")).to_have_text("Live")
    expect(rows).to_have_count(1)
    event_record(kind="worker_joined", worker=a, message="joined again", actor="agent")
    event_record(kind="worker_degraded", worker=b, message="15 of 20 failed", actor="router")
    expect(rows).to_have_count(2, timeout=LIVE_TIMEOUT_MS)
    expect(rows.first).to_contain_text("15 of 20 failed")
    expect(rows.first).to_have_class(re.compile("ev-bad"))
    assert _kinds(operator) == ["worker_degraded", "worker_degraded"]
    shot(operator, "console-events-live.png")


def test_events_page_says_what_it_cannot_filter_by(operator: Page, router: RouterServer) -> None:
    event_record(kind="policy_changed", worker=None, message="m: a -> b", actor="ops")
    operator.goto(f"{router.url}/events/?worker=abc&kind=nope&from=yesterday&since=3w")
    messages = operator.get_by_test_id("message")
    expect(messages).to_have_count(4)
    expect(messages.nth(0)).to_contain_text("No event kind 'nope'")
    expect(operator.locator("main")).to_contain_text("is not a date and time")
    expect(operator.get_by_test_id("filter-from")).to_have_value("")
    # The live page's fetch, with a nonsensical `after`: rows, not an error page.
    answer = operator.request.get(f"{router.url}/events/?partial=1&after=notanumber")
    assert answer.status == 200 and answer.text().lstrip().startswith("<li"), answer.text()[:200]


def test_the_fleet_table_fits_1024_px_buttons_and_all(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    workers = [
        add_worker(simulator("llama-3.1-8b-instruct", loras=("sql-lora", "chat-lora")),
                   name="gpu-wide-a"),
        add_worker(simulator("llama-3.1-8b-instruct"), name="gpu-wide-b"),
        add_worker(simulator("qwen-2.5-7b"), name="gpu-wide-c"),
    ]  # fmt: skip
    for width in (1280, 1024):
        operator.set_viewport_size({"width": width, "height": 800})
        for path in ("/", f"/workers/{workers[0].pk}/"):
            operator.goto(router.url + path)
            expect(operator.locator("#fleet-rows tr").first).to_be_visible()
            scrolls = operator.evaluate(
                "[...document.querySelectorAll('.table-wrap')]"
                ".map(w => w.scrollWidth - w.clientWidth)"
            )
            assert all(s <= 0 for s in scrolls), (width, path, scrolls)
            rights = operator.locator("[data-testid=remove]").evaluate_all(
                "buttons => buttons.map(b => b.getBoundingClientRect().right)"
            )
            assert rights and max(rights) <= width, (width, path, rights)
            page = "fleet" if path == "/" else "worker"
            shot(operator, f"console-{page}-table-{width}.png")
        for path in ("/", "/models/", "/events/", "/rollouts/", "/keys/", "/usage/",
                     f"/workers/{workers[0].pk}/", "/workers/999999/"):  # fmt: skip
            operator.goto(router.url + path)
            wide = operator.evaluate(STICKING_OUT)
            assert not wide, (width, path, wide)


def test_events_page_pages_back_through_the_log(operator: Page, router: RouterServer) -> None:
    Event.objects.bulk_create(
        Event(kind="policy_changed", message=f"change {i}", actor="ops") for i in range(205)
    )
    operator.goto(f"{router.url}/events/?kind=policy_changed")
    items = operator.locator("ul.events li[data-event-id]")
    expect(items).to_have_count(200)
    expect(items.first).to_contain_text("change 204")
    operator.get_by_test_id("events-older").click()
    expect(items).to_have_count(5)
    expect(items.first).to_contain_text("change 4")
    expect(operator.locator("#event-rows")).to_have_count(0)  # history: not live
    expect(operator.get_by_test_id("filter-kind")).to_have_value("policy_changed")


def test_worker_charts_redraw_from_new_history(
    operator: Page, router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("m-redraw"), name="gpu-redraw")
    _history(worker, minutes=5, end_ago=60, queue=3)
    operator.goto(f"{router.url}/workers/{worker.pk}/")
    queue = operator.locator("#charts-main figure[data-testid=chart]").first
    expect(queue.locator("text.ytick").last).to_have_text("5")
    _history(worker, minutes=1, queue=9)  # a burst since the page was drawn
    # About once a probe (5 s) the page redraws its charts; nobody reloads.
    expect(queue.locator("text.ytick").last).to_have_text("10", timeout=LIVE_TIMEOUT_MS)
