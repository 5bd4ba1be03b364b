"""Prometheus metrics for the router, served at `GET /metrics` (text format 0.0.4).

Router metrics: this process's own traffic on the model routes (/v1/chat/completions, ...):

* `controlpanel_router_requests_total{model, worker, status}`: every request, by the status
  sent to the client, router-made errors included. `worker` is "" when no worker was chosen
  (400, 404, 405, 413, 503); `model` is "" unless the request named a model this router
  serves, so a client inventing model names cannot inflate the series count. Status 499
  (nginx's convention) means the client went away before any status was sent; 500, that
  the router itself failed (uvicorn answered).
* `controlpanel_router_request_duration_seconds{model}` (histogram): request start to the
  last byte, for every request that was forwarded to a worker.
* `controlpanel_router_ttft_seconds{model}` (histogram): request start to the first body
  byte relayed from the worker, for forwarded requests answered with a status below 400.
* `controlpanel_router_alias_requests_total{alias, target}`: requests that named an alias,
  by the target model the router chose for them (routing.aliases).
* `controlpanel_router_retries_total{reason}`: attempts moved to another worker before any
  byte reached the client (`connect`, `reset`, `connect_timeout`, `status_429|502|503`).
* `controlpanel_router_fallbacks_total{model, target, reason}`: requests moved on from a
  model or alias to one of its fallbacks (routing.fallbacks).
* `controlpanel_router_worker_ejected{worker}` (gauge) and
  `controlpanel_router_ejections_total{worker}`: outlier ejection (routing.ejection).
* `controlpanel_router_queued{model}` (gauge) and
  `controlpanel_router_admission_rejected_total{model}`: admission control (routing.admission).
* `controlpanel_router_class_*{model, class}`: priority classes (routing.admission_metrics).
* `controlpanel_router_lease_slots{limit}` (gauge): this router's leases (routing.leases).
* `controlpanel_router_inflight{worker}` (gauge): requests this process has on each worker.
* `controlpanel_router_upstream_errors_total{worker, kind}`: `connect` (refused, no route,
  DNS), `reset` (the connection failed after it was made, before the response head),
  `timeout` (no connection or no response head in time), `broken_stream` (failed after
  the head was relayed), `upstream_5xx` (the worker answered 5xx; relayed as sent).

Worker metrics: the fleet as the snapshot sees it, one series per worker:

* `controlpanel_worker_up{worker}`: 1 when the worker is routable, else 0.
* `controlpanel_worker_state{worker, state}`: 1 for its state, 0 for the other states.
* `controlpanel_worker_queue_length{worker}`, when known.
* `controlpanel_worker_<name>{worker}` for every scraped value in `WorkerView.metrics`
  (running, waiting, kv_cache_usage, prefix_hit_rate, ttft_p50_seconds, ttft_p95_seconds,
  rps, ...; ttft values are taken to be in seconds, as vLLM's histograms are). An unknown
  value (None) has no sample at all: never a made-up zero.

* `controlpanel_gpu_*{worker, gpu}`: each worker's GPUs (routing.gpu_metrics).
* `vllm:*{worker, ...}`: every series vLLM itself exports, under its own name, as last
  probed (routing.vllm_metrics), so dashboards written for vLLM work through the router.

The `worker` label is the worker's name (`name#id` while two workers share a name); a
worker's counters keep its last known name after it leaves the fleet.

Multi-process rule: router metrics count only this process's requests, so summing them over
router replicas is right; scrape every router process as its own target (several uvicorn
processes behind one port would hand each scrape to a random process). Worker metrics come
from the shared registry and are the same in every replica, so summing them would count
each worker once per router: only routers with `RouterApp.exports_fleet_metrics` True export
them, and the control plane keeps that True on exactly one live router.

Cost: the request path only bumps plain dicts and lists (the event loop is the only writer,
so no locks); prometheus_client turns them into families at scrape time, in one Collector,
and the text is written out on a thread so a big fleet's page does not stall the loop.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from routing.admission_metrics import admission_families, priority_families
from routing.fallbacks import fallbacks_family
from routing.gpu_metrics import gpu_families
from routing.shared_metrics import shared_state_families
from routing.snapshot import WorkerView
from routing.vllm_metrics import vllm_families

if TYPE_CHECKING:
    from routing.policies.base import BasePolicy
    from routing.proxy import RouterApp
    from routing.sessions import Session

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED = 499

# LLM traffic: a cached embedding answers in milliseconds, a long generation takes minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
DURATION_BUCKETS = (*TTFT_BUCKETS, 120.0, 300.0)
# Finer, for rollout gates that compare two versions' p95: each bucket 25% wider than the
# last, from 1 ms to about 2 min, so an interpolated quantile is off by a few % at most.
GATE_TTFT_BUCKETS = tuple(round(0.001 * 1.25**i, 6) for i in range(53))

WORKER_STATES = ("active", "draining", "drained", "unhealthy", "offline")
UPSTREAM_ERROR_KINDS = ("connect", "reset", "timeout", "broken_stream", "upstream_5xx")

# Scraped value -> (exported name suffix, help). Names not listed are exported as they are.
WORKER_GAUGES: Mapping[str, tuple[str, str]] = {
    "running": ("running", "Requests the worker is running, as last scraped."),
    "waiting": ("waiting", "Requests waiting in the worker's queue, as last scraped."),
    "kv_cache_usage": ("kv_cache_usage", "Fraction of the worker's KV cache in use."),
    "prefix_hit_rate": ("prefix_hit_rate", "Fraction of prompt tokens served from cache."),
    "ttft_p50": ("ttft_p50_seconds", "Median time to first token at the worker."),
    "ttft_p95": ("ttft_p95_seconds", "95th percentile time to first token at the worker."),
    "rps": ("rps", "Requests per second the worker finished, recently."),
}
_GAUGE_HELP = dict(WORKER_GAUGES.values())
# Families of our own that a scraped name must never land in.
_RESERVED = frozenset({"up", "state", "queue_length"} | {n for n, _ in WORKER_GAUGES.values()})
_NOT_IN_NAME = re.compile(r"[^a-zA-Z0-9_]")


class RequestTrace:
    """What one proxied request did, filled in as it goes and recorded once at its end."""

    __slots__ = (
        "cache", "first_byte", "model", "request_id", "session", "started", "status", "worker_id",
    )  # fmt: skip

    def __init__(self, started: float) -> None:
        self.started = started
        self.model = ""
        self.worker_id: int | None = None
        self.status = 0  # 0: nothing sent yet
        self.first_byte: float | None = None
        self.request_id = b""  # routing.access_log; returned to the client on every answer
        self.session: Session | None = None  # routing.sessions, for the access log
        # A cache-aware policy's prediction checked against the answer (routing.cache_check):
        # {"decision", "predicted", "reported", "block_size"}; None when none was checked.
        self.cache: dict[str, Any] | None = None


class PlainHistogram:
    """Bucket counts in a list: observing is one bisect and two additions."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs in that bound's `le` bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        running = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return buckets


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
        # Requests whose X-Priority asked above their key's class, by the rank they got.
        self.priority_capped: defaultdict[int, int] = defaultdict(int)

    def finish(self, trace: RequestTrace, ended: float) -> None:
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


class RouterCollector(Collector):
    """The one collector of a router's registry: reads the app's plain data at scrape time."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app

    def describe(self) -> list[Metric]:
        return []  # so registering does not run a collection

    def collect(self) -> Iterator[Metric]:
        app = self.app
        yield from router_families(app.metrics, app.inflight, app.snapshot.workers)
        yield policy_info_family(app.route_policies())
        yield model_workers_family(app)
        yield policy_decisions_family(app.route_policies())
        yield alias_requests_family(app.metrics)
        yield retries_family(app.metrics)
        yield from fallbacks_family(app.metrics.fallbacks)
        yield from ejection_families(app)
        yield from admission_families(app)
        yield from priority_families(app)
        yield from shared_state_families(app.sync)
        yield from app.kv_events.families(app.metrics.worker_label)
        if app.exports_fleet_metrics:
            yield from worker_families(app.snapshot.workers, app.metrics)


class CollectedFamilies(Collector):
    """Families already collected, for generate_latest to write out on another thread."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def policy_info_family(policies: Mapping[str, BasePolicy]) -> Metric:
    """Which policy each model uses right now (value 1), so a change can be seen to land."""
    family = GaugeMetricFamily(
        "controlpanel_router_model_policy",
        "The balancing policy this router applies to each model (always 1).",
        labels=["model", "policy"],
    )
    for model, policy in policies.items():
        family.add_metric([model, policy.name], 1)
    return family


def model_workers_family(app: RouterApp) -> Metric:
    """Workers this router can send each served model to now (0: it answers 503); while
    it has ejected every one of them it tries them all, and counts them all."""
    family = GaugeMetricFamily(
        "controlpanel_router_model_workers",
        "Routable workers for each model in this router's view, less the ones it ejected.",
        labels=["model"],
    )
    for model, route in app.snapshot.routes.items():
        family.add_metric([model], len(app.ejector.routable(route.workers)))
    return family


def policy_decisions_family(policies: Mapping[str, BasePolicy]) -> Metric:
    """How each model's policy made its choices (e.g. prefix_aware: prefix vs load;
    least_kv: kv vs fallback). Counts restart when a model's policy or config changes."""
    family = CounterMetricFamily(
        "controlpanel_router_policy_decisions",
        "Routing decisions by model, policy and the reason the policy gave.",
        labels=["model", "policy", "decision"],
    )
    for model, policy in policies.items():
        for decision, count in policy.decisions.items():
            family.add_metric([model, policy.name, decision], count)
    return family


def alias_requests_family(metrics: RouterMetrics) -> Metric:
    """Which target each alias's requests went to, so a traffic split can be checked."""
    family = CounterMetricFamily(
        "controlpanel_router_alias_requests",
        "Requests that named an alias, by the alias and the target model chosen for them.",
        labels=["alias", "target"],
    )
    for (alias, target), count in metrics.alias_requests.items():
        family.add_metric([alias, target], count)
    return family


def retries_family(metrics: RouterMetrics) -> Metric:
    family = CounterMetricFamily(
        "controlpanel_router_retries",
        "Requests sent to another worker after a failure before the first byte, by cause.",
        labels=["reason"],
    )
    for reason, count in metrics.retries.items():
        family.add_metric([reason], count)
    return family


def ejection_families(app: RouterApp) -> Iterator[Metric]:
    """Workers this router took out of its rotation after failures (routing.ejection)."""
    ejector, label = app.ejector, app.metrics.worker_label
    ejected = GaugeMetricFamily(
        "controlpanel_router_worker_ejected",
        "1 while this router keeps the worker out of its rotation after failures.",
        labels=["worker"],
    )
    for worker in app.snapshot.workers:
        ejected.add_metric([label(worker.id)], 1 if worker.id in ejector.ejected_until else 0)
    yield ejected
    total = CounterMetricFamily(
        "controlpanel_router_ejections",
        "Times this router ejected the worker after consecutive failures.",
        labels=["worker"],
    )
    for worker_id, count in ejector.ejections_total.items():
        total.add_metric([label(worker_id)], count)
    yield total


def render(collector: Collector) -> bytes:
    return bytes(generate_latest(collector))


def router_families(
    metrics: RouterMetrics, inflight: Mapping[int, int], workers: Iterable[WorkerView]
) -> Iterator[Metric]:
    label = metrics.worker_label
    requests = CounterMetricFamily(
        "controlpanel_router_requests",
        "Requests on the model routes, by the status sent to the client.",
        labels=["model", "worker", "status"],
    )
    # Summed by label: a worker id that reappears under a name another id had is one series.
    by_label = _summed(((m, label(w), str(s)), n) for (m, w, s), n in metrics.requests.items())
    for labels, value in by_label.items():
        requests.add_metric(list(labels), value)
    yield requests
    yield _histogram_family(
        "controlpanel_router_request_duration_seconds",
        "Forwarded requests, from their start to the last byte sent to the client.",
        metrics.duration,
    )
    yield _histogram_family(
        "controlpanel_router_ttft_seconds",
        "Forwarded requests answered below 400, from their start to the first body byte.",
        metrics.ttft,
    )
    yield _inflight_family(metrics, inflight, workers)
    errors = CounterMetricFamily(
        "controlpanel_router_upstream_errors",
        "Failures talking to a worker, by kind (" + ", ".join(UPSTREAM_ERROR_KINDS) + ").",
        labels=["worker", "kind"],
    )
    for labels, value in _summed(
        ((label(w), kind), n) for (w, kind), n in metrics.upstream_errors.items()
    ).items():
        errors.add_metric(list(labels), value)
    yield errors


def _inflight_family(
    metrics: RouterMetrics, inflight: Mapping[int, int], workers: Iterable[WorkerView]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "controlpanel_router_inflight",
        "Requests this router process has in flight on each worker.",
        labels=["worker"],
    )
    counts = {w.id: inflight.get(w.id, 0) for w in workers}
    # A worker that just left the snapshot can still have requests finishing on it.
    counts.update((worker_id, n) for worker_id, n in inflight.items() if n)
    for labels, value in _summed(
        ((metrics.worker_label(w),), n) for w, n in counts.items()
    ).items():
        family.add_metric(list(labels), value)
    return family


def _histogram_family(
    name: str, documentation: str, table: Mapping[str, PlainHistogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=["model"])
    for model, histogram in table.items():
        family.add_metric([model], histogram.cumulative(), sum_value=histogram.total)
    return family


def worker_families(workers: Iterable[WorkerView], metrics: RouterMetrics) -> Iterator[Metric]:
    workers = tuple(workers)
    label = metrics.worker_label
    up = GaugeMetricFamily(
        "controlpanel_worker_up", "1 when the worker is routable, else 0.", labels=["worker"]
    )
    state = GaugeMetricFamily(
        "controlpanel_worker_state", "1 for the worker's current state.", labels=["worker", "state"]
    )
    queue = GaugeMetricFamily(
        "controlpanel_worker_queue_length",
        "Requests queued at the worker, as its agent last reported.",
        labels=["worker"],
    )
    for w in workers:
        up.add_metric([label(w.id)], 1 if w.routable else 0)
        states = WORKER_STATES if w.state in WORKER_STATES else (*WORKER_STATES, w.state)
        for s in states:
            state.add_metric([label(w.id), s], 1 if s == w.state else 0)
        if w.queue_length is not None:
            queue.add_metric([label(w.id)], w.queue_length)
    yield up
    yield state
    yield queue
    yield from _scraped_families(workers, label)
    yield from gpu_families(workers, label)
    yield from vllm_families(workers, label)


def _scraped_families(
    workers: tuple[WorkerView, ...], label: Callable[[int | None], str]
) -> Iterator[Metric]:
    # name -> worker label -> value; a dict, so no label set can appear twice in a family.
    values: dict[str, dict[str, float]] = {}
    for w in workers:
        for key, value in w.metrics.items():
            name = _exported_name(key)
            if name is not None and isinstance(value, int | float):
                values.setdefault(name, {})[label(w.id)] = value
    for name in sorted(values):
        documentation = _GAUGE_HELP.get(name, f"The worker's scraped value `{name}`.")
        family = GaugeMetricFamily(f"controlpanel_worker_{name}", documentation, labels=["worker"])
        for worker, value in values[name].items():
            family.add_metric([worker], value)
        yield family


def _exported_name(key: str) -> str | None:
    known = WORKER_GAUGES.get(key)
    if known is not None:
        return known[0]
    name = _NOT_IN_NAME.sub("_", key)
    return None if not name or name in _RESERVED else name


def _summed(items: Iterable[tuple[tuple[str, ...], int]]) -> dict[tuple[str, ...], int]:
    totals: dict[tuple[str, ...], int] = {}
    for labels, value in items:
        totals[labels] = totals.get(labels, 0) + value
    return totals
