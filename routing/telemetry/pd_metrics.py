"""/metrics for prefill/decode disaggregation (routing.pd), per model unless said:

* `controlpanel_router_pd_transfers_total{model}`: prefill legs that handed their KV cache
  to a decode leg (transfer parameters received);
* `controlpanel_router_pd_bypasses_total{model, reason}`: requests of a disaggregated
  model sent straight to a decode-capable worker: `short_prompt` (its uncached prompt is
  under the model's threshold), `cached_prompt` (the chosen prefill worker holds nearly all
  of it), `no_prefill_worker` (none routable);
* `controlpanel_router_pd_prefill_failures_total{model, reason}`: prefill attempts that
  failed before their answer and moved to another prefill worker;
* `controlpanel_router_pd_prefill_seconds{model}` (histogram): the prefill leg, retries
  included;
* `controlpanel_router_pd_decode_first_byte_seconds{model}` (histogram): from the end of
  the prefill leg to the decode leg's first byte;
* `controlpanel_worker_role{worker, role}`: 1 for each worker's role (prefill, decode,
  both), to break the per-worker load series down by role.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from routing.fleet.snapshot import WorkerView
from routing.histograms import histogram_family
from routing.telemetry.counters import RouterMetrics


def pd_families(metrics: RouterMetrics, workers: Iterable[WorkerView]) -> Iterator[Metric]:
    transfers = CounterMetricFamily(
        "controlpanel_router_pd_transfers",
        "Prefill legs whose KV cache went on to a decode leg.",
        labels=["model"],
    )
    for model, count in metrics.pd_transfers.items():
        transfers.add_metric([model], count)
    yield transfers
    yield _by_reason(
        "controlpanel_router_pd_bypasses",
        "Disaggregated requests sent straight to a decode-capable worker, by reason.",
        metrics.pd_bypasses,
    )
    yield _by_reason(
        "controlpanel_router_pd_prefill_failures",
        "Prefill attempts that failed before their answer, by reason.",
        metrics.pd_prefill_failures,
    )
    yield histogram_family(
        "controlpanel_router_pd_prefill_seconds",
        "The prefill leg of disaggregated requests, retries included.",
        metrics.pd_prefill,
    )
    yield histogram_family(
        "controlpanel_router_pd_decode_first_byte_seconds",
        "From the end of the prefill leg to the decode leg's first byte.",
        metrics.pd_decode_ttft,
    )
    roles = GaugeMetricFamily(
        "controlpanel_worker_role", "Each worker's role (1): prefill, decode or both.",
        labels=["worker", "role"],
    )  # fmt: skip
    for worker in workers:
        roles.add_metric([metrics.worker_label(worker.id), worker.role], 1)
    yield roles


def _by_reason(name: str, documentation: str, counts: dict[tuple[str, str], int]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=["model", "reason"])
    for (model, reason), count in counts.items():
        family.add_metric([model, reason], count)
    return family
