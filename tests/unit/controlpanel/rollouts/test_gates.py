"""Rollout gates (controlpanel.rollouts.gates), pure functions of routers' totals: a step's
window, the bucketed p95, and the verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.rollouts import gates
from routing.telemetry.counters import GATE_TTFT_BUCKETS

SIZE = len(GATE_TTFT_BUCKETS) + 1
LIMITS = gates.Thresholds(max_error_rate=0.05, max_ttft_p95_ratio=1.5, min_requests=20)


def at(seconds: float, count: int) -> tuple[int, ...]:
    """`count` requests whose first token came within the bucket holding `seconds`."""
    counts = [0] * SIZE
    counts[sum(1 for bound in GATE_TTFT_BUCKETS if bound < seconds)] = count
    return tuple(counts)


def totals(requests: int, errors: int = 0, ttft: tuple[int, ...] | None = None) -> dict[str, Any]:
    return {"requests": requests, "errors": errors, "ttft": list(ttft or at(0.1, requests))}


def test_a_window_sums_the_routers_that_have_a_baseline() -> None:
    baseline = {"r1": {"new": totals(10, 1)}, "r2": {}}
    current = {
        "r1": {"new": totals(30, 2), "old": totals(5)},
        "r2": {"new": totals(7, 1)},  # first report with the step's weights: all of it counts
        "r3": {"new": totals(1000, 1000)},  # no baseline yet: routing with older weights
    }
    new = gates.window(baseline, current, "new")
    assert (new.requests, new.errors) == (20 + 7, 1 + 1)
    assert sum(new.ttft_counts) == 27
    assert gates.window(baseline, current, "old").requests == 5
    assert gates.window(baseline, current, "missing") == gates.TargetWindow(0, 0, (0,) * SIZE)


def test_a_router_restart_never_counts_negative_traffic() -> None:
    baseline = {"r1": {"new": totals(100, 10)}}
    restarted = {"r1": {"new": totals(3, 0)}}
    window = gates.window(baseline, restarted, "new")
    assert (window.requests, window.errors) == (0, 0)
    assert min(window.ttft_counts) == 0


def test_ttft_counts_of_another_bucket_layout_are_ignored() -> None:
    current = {"r1": {"new": {"requests": 5, "errors": 0, "ttft": [5, 0, 0]}}}
    window = gates.window({"r1": {}}, current, "new")
    assert window.requests == 5 and window.ttft_p95 is None


def test_quantiles_of_bucketed_times() -> None:
    assert gates.quantile((0,) * SIZE, 0.95) is None
    assert gates.quantile((1, 2), 0.5) is None  # not this layout
    beyond = [0] * SIZE
    beyond[-1] = 4
    assert gates.quantile(beyond, 0.95) == GATE_TTFT_BUCKETS[-1]
    p95 = gates.quantile(at(0.2, 100), 0.95)
    assert p95 is not None
    i = sum(1 for bound in GATE_TTFT_BUCKETS if bound < 0.2)
    assert GATE_TTFT_BUCKETS[i - 1] < p95 <= GATE_TTFT_BUCKETS[i]


def verdict(
    new: gates.TargetWindow,
    old: gates.TargetWindow | None = None,
    *,
    hold_over: bool = True,
    worker: bool = True,
    reference: float | None = None,
) -> gates.GateCheck:
    return gates.evaluate(
        new=new, old=old or gates.TargetWindow(), thresholds=LIMITS, reference_p95=reference,
        hold_over=hold_over, new_has_worker=worker, window_seconds=10.0,
    )  # fmt: skip


def test_no_healthy_worker_fails_at_once() -> None:
    check = verdict(gates.TargetWindow(), worker=False)
    assert (check.verdict, check.reason) == ("fail", "the new target has no healthy worker")


def test_too_few_requests_wait_however_bad_they_are() -> None:
    check = verdict(gates.TargetWindow(5, 5, at(9.0, 5)))
    assert (check.verdict, check.reason) == (
        "wait",
        "waiting for 15 more requests to the new target",
    )


def test_errors_fail_before_the_hold_is_over() -> None:
    check = verdict(gates.TargetWindow(20, 2, at(0.1, 20)), hold_over=False)
    assert check.verdict == "fail"
    assert check.reason == "error rate 10.0% over 20 requests exceeds the gate of 5.0%"


@pytest.mark.parametrize(("hold_over", "expected"), [(True, "pass"), (False, "wait")])
def test_good_traffic_passes_only_once_the_hold_is_over(hold_over: bool, expected: str) -> None:
    good = gates.TargetWindow(20, 1, at(0.1, 20))  # 5%: at the gate, not over it
    assert verdict(good, hold_over=hold_over).verdict == expected


def test_latency_is_compared_with_the_old_target_or_else_the_reference() -> None:
    slow = gates.TargetWindow(20, 0, at(0.5, 20))
    old_fast = gates.TargetWindow(20, 0, at(0.1, 20))
    check = verdict(slow, old_fast)
    assert check.verdict == "fail" and "the old target's" in check.reason
    assert check.p95_ratio is not None and check.p95_ratio > LIMITS.max_ttft_p95_ratio
    # too little old traffic to trust its p95: the reference from an earlier step counts
    few_old = gates.TargetWindow(3, 0, at(0.1, 3))
    assert verdict(slow, few_old).verdict == "pass"  # no reference: latency unjudged
    assert verdict(slow, few_old, reference=0.5).verdict == "pass"
    assert verdict(slow, few_old, reference=0.1).verdict == "fail"


def test_a_check_as_stored_has_rates_over_its_window() -> None:
    check = verdict(gates.TargetWindow(20, 1, at(0.1, 20)), gates.TargetWindow(40, 0, at(0.1, 40)))
    stored = check.as_dict()
    assert stored["verdict"] == "pass" and stored["window_seconds"] == 10.0
    assert stored["new"]["rps"] == 2.0 and stored["old"]["rps"] == 4.0
    assert stored["new"]["error_rate"] == 0.05 and stored["p95_ratio"] == pytest.approx(1.0)
    assert gates.thresholds_dict(LIMITS) == {
        "max_error_rate": 0.05, "max_ttft_p95_ratio": 1.5, "min_requests": 20,
    }  # fmt: skip
