"""Rollout gates: is the new target as good as the old one over the current step?

The routers report, per served model, cumulative totals since they started (requests,
5xx answers and fine time-to-first-token bucket counts; routing.telemetry.metrics.model_totals). A
step's window is the difference between the totals now and each router's totals in its
first report made while routing with the step's weights, so the figures are the routers'
own measurements of the traffic that step carried, summed over every router replica.

Verdicts: "fail" as soon as the new target has served `min_requests` and breaks a gate (or
has no healthy worker at all); "pass" once the hold is over and the new target has served
`min_requests` without breaking one; otherwise "wait".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from routing.telemetry.counters import GATE_TTFT_BUCKETS

Totals = Mapping[str, Mapping[str, Mapping[str, Any]]]  # router instance -> model -> totals


@dataclass(frozen=True)
class TargetWindow:
    """One target's traffic over a step's window."""

    requests: int = 0
    errors: int = 0
    ttft_counts: tuple[int, ...] = field(default=(), repr=False)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def ttft_p95(self) -> float | None:
        return quantile(self.ttft_counts, 0.95)


@dataclass(frozen=True)
class Thresholds:
    max_error_rate: float
    max_ttft_p95_ratio: float
    min_requests: int


@dataclass(frozen=True)
class GateCheck:
    verdict: str  # "pass", "fail" or "wait"
    reason: str
    new: TargetWindow
    old: TargetWindow
    old_p95_reference: float | None  # what the new target's p95 is compared with
    window_seconds: float

    @property
    def p95_ratio(self) -> float | None:
        new, ref = self.new.ttft_p95, self.old_p95_reference
        return new / ref if new is not None and ref else None

    def as_dict(self) -> dict[str, Any]:
        def side(w: TargetWindow) -> dict[str, Any]:
            rate = w.requests / self.window_seconds if self.window_seconds > 0 else None
            return {
                "requests": w.requests,
                "errors": w.errors,
                "error_rate": w.error_rate,
                "ttft_p95": w.ttft_p95,
                "rps": rate,
            }

        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "new": side(self.new),
            "old": side(self.old),
            "old_p95_reference": self.old_p95_reference,
            "p95_ratio": self.p95_ratio,
            "window_seconds": round(self.window_seconds, 3),
        }


def window(baseline: Totals, current: Totals, model: str) -> TargetWindow:
    """What `model` served between `baseline` and `current`, summed over the routers that
    have a baseline (a router without one has not yet routed with the step's weights)."""
    requests = errors = 0
    buckets = [0] * (len(GATE_TTFT_BUCKETS) + 1)
    for instance, models in current.items():
        now = models.get(model)
        if now is None or instance not in baseline:
            continue
        before = baseline[instance].get(model, {})
        requests += max(0, int(now.get("requests", 0)) - int(before.get("requests", 0)))
        errors += max(0, int(now.get("errors", 0)) - int(before.get("errors", 0)))
        for i, (a, b) in enumerate(zip(_counts(now), _counts(before), strict=True)):
            buckets[i] += max(0, a - b)
    return TargetWindow(requests, errors, tuple(buckets))


def _counts(totals: Mapping[str, Any]) -> list[int]:
    counts = totals.get("ttft") or []
    size = len(GATE_TTFT_BUCKETS) + 1
    return [int(c) for c in counts] if len(counts) == size else [0] * size


def quantile(counts: tuple[int, ...] | list[int], q: float) -> float | None:
    """The q-quantile of a bucketed distribution, linear within its bucket."""
    total = sum(counts)
    if not total or len(counts) != len(GATE_TTFT_BUCKETS) + 1:
        return None
    rank = q * total
    running = 0
    lower = 0.0
    for bound, count in zip((*GATE_TTFT_BUCKETS, None), counts, strict=True):
        if count and running + count >= rank:
            if bound is None:
                return lower  # beyond the last bound: the bound is all we know
            return lower + (bound - lower) * (rank - running) / count
        running += count
        lower = bound if bound is not None else lower
    return lower


def evaluate(
    *,
    new: TargetWindow,
    old: TargetWindow,
    thresholds: Thresholds,
    reference_p95: float | None,
    hold_over: bool,
    new_has_worker: bool,
    window_seconds: float,
) -> GateCheck:
    old_p95 = old.ttft_p95 if old.requests >= thresholds.min_requests else None
    reference = old_p95 if old_p95 is not None else reference_p95

    def check(verdict: str, reason: str) -> GateCheck:
        return GateCheck(verdict, reason, new, old, reference, window_seconds)

    if not new_has_worker:
        return check("fail", "the new target has no healthy worker")
    if new.requests >= thresholds.min_requests:
        failure = _broken_gate(new, reference, thresholds)
        if failure:
            return check("fail", failure)
        if hold_over:
            return check("pass", "gates passed")
        return check("wait", "holding; gates pass so far")
    missing = thresholds.min_requests - new.requests
    return check("wait", f"waiting for {missing} more requests to the new target")


def _broken_gate(new: TargetWindow, reference: float | None, t: Thresholds) -> str | None:
    rate = new.error_rate or 0.0
    if rate > t.max_error_rate:
        return (
            f"error rate {rate:.1%} over {new.requests} requests "
            f"exceeds the gate of {t.max_error_rate:.1%}"
        )
    p95 = new.ttft_p95
    if p95 is not None and reference:
        ratio = p95 / reference
        if ratio > t.max_ttft_p95_ratio:
            return (
                f"p95 time to first token {p95 * 1000:.0f} ms is {ratio:.2f}x the old "
                f"target's {reference * 1000:.0f} ms (gate {t.max_ttft_p95_ratio:.2f}x)"
            )
    return None


def thresholds_dict(t: Thresholds) -> dict[str, Any]:
    return asdict(t)
