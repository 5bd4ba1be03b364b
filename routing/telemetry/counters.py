"""The router's own counters as plain data, bumped on the request path (no locks: the event
loop is the only writer) and turned into Prometheus families only at scrape time
(routing.telemetry.metrics)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from routing.fleet.snapshot import WorkerView
from routing.histograms import PlainHistogram

if TYPE_CHECKING:
    from routing.exchange import Exchange

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED = 499

# LLM traffic: a cached embedding answers in milliseconds, a long generation takes minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
DURATION_BUCKETS = (*TTFT_BUCKETS, 120.0, 300.0)
# Finer, for rollout gates that compare two versions' p95: each bucket 25% wider than the
# last, from 1 ms to about 2 min, so an interpolated quantile is off by a few % at most.
GATE_TTFT_BUCKETS = tuple(round(0.001 * 1.25**i, 6) for i in range(53))


class RouterMetrics:
    """The router's own counters, as plain data; keyed by worker id, named at scrape time."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int | None, int], int] = defaultdict(int)
        self.upstream_errors: defaultdict[tuple[int, str], int] = defaultdict(int)
        self.duration: dict[str, PlainHistogram] = {}
        self.ttft: dict[str, PlainHistogram] = {}
        self.worker_names: dict[int, str] = {}
        self.alias_requests: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.retries: defaultdict[str, int] = defaultdict(int)
        self.fallbacks: dict[tuple[str, str, str], int] = {}  # (from, to, reason)
        self.gate_ttft: dict[str, PlainHistogram] = {}
        # Prefill/decode disaggregation (routing.pd), per model: prefill legs that produced
        # transfer parameters, bypasses by reason, prefill attempts failed by reason, the
        # prefill leg's seconds and the decode leg's first byte after it.
        self.pd_transfers: defaultdict[str, int] = defaultdict(int)
        self.pd_bypasses: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.pd_prefill_failures: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.pd_prefill: dict[str, PlainHistogram] = {}
        self.pd_decode_ttft: dict[str, PlainHistogram] = {}
        # Requests whose X-Priority asked above their key's class, by the rank they got.
        self.priority_capped: defaultdict[int, int] = defaultdict(int)

    def finish(self, trace: Exchange, ended: float) -> None:
        """A request's end: its status, worker, duration and time to first byte."""
        status = trace.status or CLIENT_CLOSED
        self.requests[trace.model, trace.worker_id, status] += 1
        if trace.worker_id is None:
            return  # rejected by the router itself: its latency says nothing about the fleet
        model = trace.model
        duration = self.duration.get(model)
        if duration is None:
            duration = self.duration[model] = PlainHistogram(DURATION_BUCKETS)
        duration.observe(ended - trace.started)
        if trace.first_byte is not None and status < 400:
            ttft = self.ttft.get(model)
            if ttft is None:
                ttft = self.ttft[model] = PlainHistogram(TTFT_BUCKETS)
                self.gate_ttft[model] = PlainHistogram(GATE_TTFT_BUCKETS)
            ttft.observe(trace.first_byte - trace.started)
            self.gate_ttft[model].observe(trace.first_byte - trace.started)
        if trace.pd is not None and "prefilled_at" in trace.pd:
            self._pd_finish(model, trace.pd, trace.first_byte)

    def _pd_finish(self, model: str, pd: dict[str, Any], first_byte: float | None) -> None:
        """A disaggregated request's two stages: the prefill leg, the decode's first byte."""
        prefill = self.pd_prefill.get(model)
        if prefill is None:
            prefill = self.pd_prefill[model] = PlainHistogram(TTFT_BUCKETS)
            self.pd_decode_ttft[model] = PlainHistogram(TTFT_BUCKETS)
        prefill.observe(pd["prefill_seconds"])
        if first_byte is not None:
            self.pd_decode_ttft[model].observe(max(0.0, first_byte - pd["prefilled_at"]))

    def worker_totals(self) -> dict[int, tuple[int, int]]:
        """Requests and failed requests (5xx, router-made 502/504 included) per worker, since
        this process started; the refresher turns them into recent rates."""
        totals: dict[int, list[int]] = {}
        for (_, worker_id, status), count in self.requests.items():
            if worker_id is None:
                continue
            pair = totals.setdefault(worker_id, [0, 0])
            pair[0] += count
            if status >= 500:
                pair[1] += count
        return {worker_id: (pair[0], pair[1]) for worker_id, pair in totals.items()}

    def model_totals(self) -> dict[str, dict[str, Any]]:
        """Per served model since this process started: requests, failed requests (5xx) and
        the fine TTFT bucket counts, which the control plane's rollout gates difference over
        a step's window (controlpanel.gates)."""
        counts: dict[str, list[int]] = {}
        for (model, _, status), count in self.requests.items():
            if model:
                pair = counts.setdefault(model, [0, 0])
                pair[0] += count
                if status >= 500:
                    pair[1] += count
        empty = PlainHistogram(())
        return {
            model: {
                "requests": requests,
                "errors": errors,
                "ttft": list(self.gate_ttft.get(model, empty).counts),
            }
            for model, (requests, errors) in counts.items()
        }

    def upstream_error(self, worker_id: int, kind: str) -> None:
        self.upstream_errors[worker_id, kind] += 1

    def name_workers(self, workers: Iterable[WorkerView]) -> None:
        """Called with every new snapshot, off the request path."""
        workers = tuple(workers)
        shared = Counter(w.name for w in workers)
        for w in workers:
            self.worker_names[w.id] = w.name if shared[w.name] == 1 else f"{w.name}#{w.id}"

    def worker_label(self, worker_id: int | None) -> str:
        if worker_id is None:
            return ""
        return self.worker_names.get(worker_id, f"#{worker_id}")
