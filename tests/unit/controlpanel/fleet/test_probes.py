"""The Celery health probe's parsing (controlpanel.fleet.probes), on /metrics texts
recorded from vLLM (tests.support.recorded_metrics): one with today's metric names and one
with the older `gpu_*` names; rates from the deltas between two probes."""

from __future__ import annotations

from unittest.mock import ANY

import httpx
import pytest

from controlpanel.fleet import probes
from tests.support.recorded_metrics import (
    NEW_MODEL,
    OLD_MODEL,
    RECORDED_NEW,
    RECORDED_OLD,
    advance,
    key,
    sleep_lines,
)

pytestmark = pytest.mark.django_db(transaction=True)

LATER_BOUNDS = ("0.25", "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0")
LATER_BOUNDS += ("80.0", "160.0", "640.0", "2560.0", "+Inf")


def new_scrape_five_seconds_later() -> str:
    """Engine 0 answered 10 requests: 4000 prompt tokens looked up, 3000 of them cached,
    first tokens after 0.02-0.04 s (2), 0.04-0.06 s (4), 0.06-0.08 s (2), 0.08-0.1 s (2)."""
    engine0 = {"engine": "0", "model_name": NEW_MODEL}
    increments = {
        key("vllm:prefix_cache_queries_total", **engine0): 4000,
        key("vllm:prefix_cache_hits_total", **engine0): 3000,
        key("vllm:request_success_total", finished_reason="stop", **engine0): 8,
        key("vllm:request_success_total", finished_reason="length", **engine0): 2,
    }
    ttft = "vllm:time_to_first_token_seconds"
    growth = {"0.04": 2, "0.06": 6, "0.08": 8, "0.1": 10} | dict.fromkeys(LATER_BOUNDS, 10)
    for le, added in growth.items():
        increments[key(f"{ttft}_bucket", le=le, **engine0)] = added
    increments[key(f"{ttft}_count", **engine0)] = 10
    return advance(RECORDED_NEW, increments)


# --- parsing, on recorded texts ------------------------------------------------------------


def parsed(text: str) -> probes.Scrape:
    scrape = probes.parse_scrape(text)
    assert scrape is not None
    return scrape


def test_parse_recorded_sample_with_current_names() -> None:
    scrape = parsed(RECORDED_NEW)
    assert scrape.running == 4  # summed over both engines
    assert scrape.waiting == 2
    assert scrape.kv_cache_usage == pytest.approx(0.1875)  # the engines' mean
    assert scrape.prefix_queries == 1_800_000 and scrape.prefix_hits == 1_000_000
    assert scrape.requests == 2041  # every finished_reason, both engines
    assert scrape.sleeping is False  # awake=1: not "value > 0 means sleeping"
    assert scrape.ttft_buckets is not None
    assert scrape.ttft_buckets["0.1"] == 800 and scrape.ttft_buckets["+Inf"] == 968


def test_parse_recorded_sample_with_old_names() -> None:
    scrape = parsed(RECORDED_OLD)
    assert (scrape.running, scrape.waiting) == (2, 5)
    assert scrape.kv_cache_usage == pytest.approx(0.62)
    assert (scrape.prefix_queries, scrape.prefix_hits) == (20480, 5120)
    assert scrape.requests == 320
    assert scrape.ttft_buckets is None and scrape.sleeping is None

    later = advance(
        RECORDED_OLD,
        {
            key("vllm:gpu_prefix_cache_queries_total", model_name=OLD_MODEL): 100,
            key("vllm:gpu_prefix_cache_hits_total", model_name=OLD_MODEL): 25,
        },
    )
    first = probes.read_metrics(RECORDED_OLD, previous={}, at=100.0)
    second = probes.read_metrics(later, previous=first.counters, at=105.0)
    assert second.metrics["prefix_hit_rate"] == pytest.approx(0.25)
    assert second.metrics["kv_cache_usage"] == pytest.approx(0.62)
    assert second.metrics["ttft_p50"] is None  # not exported: unknown, not zero


def test_the_current_name_wins_when_a_server_exports_both() -> None:
    text = "vllm:kv_cache_usage_perc 0.3\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parsed(text).kv_cache_usage == pytest.approx(0.3)


def test_first_probe_has_load_but_no_rates() -> None:
    reading = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    assert reading.metrics == {
        "running": 4,
        "waiting": 2,
        "kv_cache_usage": pytest.approx(0.1875),
        "prefix_hit_rate": None,
        "ttft_p50": None,
        "ttft_p95": None,
        "rps": None,
        # vLLM's own series, kept for the router (tests/e2e/test_vllm_metrics.py)
        "vllm_series": ANY,
    }
    assert reading.counters["at"] == 1000.0
    assert reading.counters["prefix_queries"] == 1_800_000


def test_rates_come_from_deltas_between_two_probes() -> None:
    first = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    # As stored in Worker.scrape_state: through JSON.
    stored = httpx.Response(200, json=first.counters).json()
    second = probes.read_metrics(new_scrape_five_seconds_later(), previous=stored, at=1005.0)
    metrics = second.metrics
    assert metrics["prefix_hit_rate"] == pytest.approx(0.75)  # not the lifetime 0.56
    assert metrics["rps"] == pytest.approx(2.0)
    # p50: rank 5 of 10 lies in (0.04, 0.06] holding ranks 3-6 -> 0.04 + 0.02 * 3/4.
    assert metrics["ttft_p50"] == pytest.approx(0.055)
    # p95: rank 9.5 lies in (0.08, 0.1] holding ranks 9-10 -> 0.08 + 0.02 * 1.5/2.
    assert metrics["ttft_p95"] == pytest.approx(0.095)


def test_no_traffic_between_probes_gives_unknown_rates_not_zero() -> None:
    first = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    second = probes.read_metrics(RECORDED_NEW, previous=first.counters, at=1005.0)
    assert second.metrics["prefix_hit_rate"] is None
    assert second.metrics["ttft_p50"] is None and second.metrics["ttft_p95"] is None
    assert second.metrics["rps"] == 0.0  # measured: no request finished in 5 s


def test_counter_reset_counts_everything_since_the_restart() -> None:
    before = probes.read_metrics(new_scrape_five_seconds_later(), previous={}, at=1000.0)
    after = probes.read_metrics(RECORDED_NEW, previous=before.counters, at=1010.0)
    assert after.metrics["prefix_hit_rate"] == pytest.approx(1_000_000 / 1_800_000)
    assert after.metrics["rps"] == pytest.approx(2041 / 10)
    assert after.metrics["ttft_p50"] is not None


@pytest.mark.parametrize("text", ["", "# nothing here\n", "<html><body>502</body></html>"])
def test_missing_or_unreadable_metrics_are_none(text: str) -> None:
    reading = probes.read_metrics(text, previous={}, at=1.0)
    assert reading.metrics == dict.fromkeys(probes.METRIC_KEYS)
    assert reading.sleeping is None


def test_a_failed_scrape_keeps_the_previous_counters() -> None:
    first = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    failed = probes.read_metrics(None, previous=first.counters, at=1005.0)
    assert failed.metrics == dict.fromkeys(probes.METRIC_KEYS)
    assert failed.counters == first.counters
    garbled = probes.read_metrics("<html>502</html>", previous=first.counters, at=1005.0)
    assert garbled.counters == first.counters
    # The next good scrape measures over both intervals.
    third = probes.read_metrics(
        new_scrape_five_seconds_later(), previous=failed.counters, at=1010.0
    )
    assert third.metrics["rps"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("text", "sleeping"),
    [
        (sleep_lines(1, 0, 0), False),
        (sleep_lines(0, 1, 0), True),  # sleep level 1
        (sleep_lines(0, 0, 1), True),  # sleep level 2
        ("vllm:engine_sleep_state 1\n", True),  # unlabelled: above zero means asleep
        ("vllm:engine_sleep_state 0\n", False),
        ("vllm:num_requests_running 0\n", None),
    ],
)
def test_engine_sleep_state(text: str, sleeping: bool | None) -> None:
    assert parsed(text).sleeping is sleeping


def test_histogram_quantile_edges() -> None:
    assert probes.histogram_quantile(0.5, []) is None
    assert probes.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    # Everything above the last finite bound: Prometheus answers that bound.
    assert probes.histogram_quantile(0.5, [(0.1, 0.0), (1.0, 0.0), (float("inf"), 4.0)]) == 1.0
    assert probes.histogram_quantile(0.5, [(0.1, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.05)
