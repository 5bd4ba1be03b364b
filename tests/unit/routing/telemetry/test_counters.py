"""The router's own counters (routing.telemetry.counters): what a request's end records,
and the totals the refresher sends to the control plane."""

from __future__ import annotations

from typing import Any

from bench.common.workers import worker_view
from routing.exchange import Exchange
from routing.telemetry.counters import CLIENT_CLOSED, GATE_TTFT_BUCKETS, RouterMetrics
from tests.support.exchanges import exchange


def ended(model: str, worker_id: int | None, status: int, **fields: Any) -> Exchange:
    return exchange(None, started=10.0, model=model, worker_id=worker_id, status=status, **fields)


def test_a_requests_end_counts_it_with_its_duration_and_time_to_first_byte() -> None:
    metrics = RouterMetrics()
    metrics.finish(ended("m", 1, 200, first_byte=10.5), ended=12.0)
    metrics.finish(ended("m", 1, 500, first_byte=10.2), ended=11.0)  # no TTFT for a failure
    metrics.finish(ended("m", 2, 0), ended=13.0)  # the client left before any answer
    assert metrics.requests == {("m", 1, 200): 1, ("m", 1, 500): 1, ("m", 2, CLIENT_CLOSED): 1}
    assert sum(metrics.duration["m"].counts) == 3 and metrics.duration["m"].total == 6.0
    assert sum(metrics.ttft["m"].counts) == 1 and metrics.ttft["m"].total == 0.5


def test_the_routers_own_refusals_say_nothing_of_the_fleets_latency() -> None:
    metrics = RouterMetrics()
    metrics.finish(ended("m", None, 429), ended=11.0)
    assert metrics.requests == {("m", None, 429): 1}
    assert metrics.duration == {} and metrics.worker_totals() == {}


def test_a_disaggregated_request_records_both_of_its_stages() -> None:
    metrics = RouterMetrics()
    pd = {"worker": "p1", "prefill_seconds": 0.3, "prefilled_at": 10.3}
    metrics.finish(ended("m", 1, 200, first_byte=10.5, pd=pd), ended=11.0)
    assert metrics.pd_prefill["m"].total == 0.3
    assert round(metrics.pd_decode_ttft["m"].total, 6) == 0.2
    bypassed = RouterMetrics()
    bypassed.finish(ended("m", 1, 200, pd={"bypass": "short_prompt"}), ended=11.0)
    assert bypassed.pd_prefill == {}


def test_totals_per_worker_and_per_model_count_failures_as_5xx() -> None:
    metrics = RouterMetrics()
    for status in (200, 200, 502, 404):
        metrics.finish(ended("m", 1, status, first_byte=10.01), ended=11.0)
    metrics.finish(ended("n", 2, 503), ended=11.0)
    metrics.finish(ended("", None, 401), ended=11.0)  # no model: not a model's request
    assert metrics.worker_totals() == {1: (4, 1), 2: (1, 1)}
    totals = metrics.model_totals()
    assert set(totals) == {"m", "n"}
    assert (totals["m"]["requests"], totals["m"]["errors"]) == (4, 1)
    assert len(totals["m"]["ttft"]) == len(GATE_TTFT_BUCKETS) + 1
    assert sum(totals["m"]["ttft"]) == 2  # the two answered below 400
    assert totals["n"]["ttft"] == [0]  # no first byte yet: an empty histogram


def test_workers_sharing_a_name_are_told_apart_by_id() -> None:
    metrics = RouterMetrics()
    metrics.name_workers([worker_view(1, name="gpu"), worker_view(2, name="gpu"), worker_view(3)])
    assert [metrics.worker_label(i) for i in (1, 2, 3, 9, None)] == [
        "gpu#1", "gpu#2", "w3", "#9", "",
    ]  # fmt: skip
    metrics.upstream_error(1, "reset")
    metrics.upstream_error(1, "reset")
    assert metrics.upstream_errors == {(1, "reset"): 2}
