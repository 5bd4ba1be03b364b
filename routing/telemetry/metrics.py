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
  by the target model the router chose for them (routing.fleet.aliases).
* `controlpanel_router_retries_total{reason}`: attempts moved to another worker before any
  byte reached the client (`connect`, `reset`, `connect_timeout`, `status_429|502|503`).
* `controlpanel_router_fallbacks_total{model, target, reason}`: requests moved on from a
  model or alias to one of its fallbacks (routing.fleet.fallbacks).
* `controlpanel_router_worker_ejected{worker}` (gauge) and
  `controlpanel_router_ejections_total{worker}`: outlier ejection (routing.clients.ejection).
* `controlpanel_router_queued{model}` (gauge) and
  `controlpanel_router_admission_rejected_total{model}`: admission control
  (routing.admission.admission).
* `controlpanel_router_class_*{model, class}`: priority classes
(routing.telemetry.admission_metrics).
* `controlpanel_router_lease_slots{limit}` (gauge): this router's leases (routing.admission.leases).
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

* `controlpanel_gpu_*{worker, gpu}`: each worker's GPUs (routing.telemetry.gpu_metrics).
* `vllm:*{worker, ...}`: every series vLLM itself exports, under its own name, as last
  probed (routing.telemetry.vllm_metrics), so dashboards written for vLLM work through the router.

The `worker` label is the worker's name (`name#id` while two workers share a name); a
worker's counters keep its last known name after it leaves the fleet.

Multi-process rule: router metrics count only this process's requests, so summing them over
router replicas is right; scrape every router process as its own target (several uvicorn
processes behind one port would hand each scrape to a random process). Worker metrics come
from the shared registry and are the same in every replica, so summing them would count
each worker once per router: only routers with `RouterView.exports_fleet_metrics` True export
them, and the control plane keeps that True on exactly one live router.

Cost: the request path only bumps plain dicts and lists (the event loop is the only writer,
so no locks); prometheus_client turns them into families at scrape time, in one Collector,
and the text is written out on a thread so a big fleet's page does not stall the loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from routing.fleet.fallbacks import fallbacks_family
from routing.fleet.snapshot import WorkerView
from routing.histograms import histogram_family
from routing.telemetry.admission_metrics import admission_families, priority_families
from routing.telemetry.counters import (
    RouterMetrics,
)
from routing.telemetry.gpu_metrics import gpu_families
from routing.telemetry.pd_metrics import pd_families
from routing.telemetry.shared_metrics import shared_state_families
from routing.telemetry.vllm_metrics import vllm_families

if TYPE_CHECKING:
    from routing.policies.base import BasePolicy
    from routing.telemetry.router_view import RouterView

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


class RouterCollector(Collector):
    """The one collector of a router's registry: reads the app's plain data at scrape time."""

    def __init__(self, app: RouterView) -> None:
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
        yield from pd_families(
            app.metrics, app.snapshot.workers if app.exports_fleet_metrics else ()
        )
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


def model_workers_family(app: RouterView) -> Metric:
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


def ejection_families(app: RouterView) -> Iterator[Metric]:
    """Workers this router took out of its rotation after failures (routing.clients.ejection)."""
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
    yield histogram_family(
        "controlpanel_router_request_duration_seconds",
        "Forwarded requests, from their start to the last byte sent to the client.",
        metrics.duration,
    )
    yield histogram_family(
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
