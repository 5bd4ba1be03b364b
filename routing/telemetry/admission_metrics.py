"""/metrics for admission control (routing.admission.admission). Per model, requests waiting and
turned away: `controlpanel_router_queued{model}` and
`controlpanel_router_admission_rejected_total{model}`. Per model and priority class
(routing.fleet.priority):

* `controlpanel_router_class_queued{model, class}` (gauge): waiting for room now;
* `controlpanel_router_class_admitted_total{model, class}`: admitted under the limits;
* `controlpanel_router_class_shed_total{model, class}`: shed at once (429) under saturation;
* `controlpanel_router_class_waited_total{model, class}` and
  `controlpanel_router_class_wait_seconds_total{model, class}`: requests that had to queue,
  and the time they spent there (their ratio is the mean wait of those that waited);
* `controlpanel_router_priority_capped_total{class}`: requests whose X-Priority asked above
  their key's class, by the class they were given;
* `controlpanel_router_budget_refusals_total{period}`: requests refused because their key's
  daily or monthly token budget (routing.admission.budgets) was used up.

Admission counts exist only where a limit applies (without one nothing queues or sheds).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from routing.fleet.priority import PRIORITIES

if TYPE_CHECKING:
    from routing.telemetry.router_view import RouterView


def priority_families(app: RouterView) -> Iterator[Metric]:
    admission = app.admission
    queued = GaugeMetricFamily(
        "controlpanel_router_class_queued",
        "Requests waiting for room under the in-flight limits, by model and priority class.",
        labels=["model", "class"],
    )
    for (model, name), count in admission.queued_by_class().items():
        queued.add_metric([model, name], count)
    yield queued
    families: tuple[tuple[str, str, Mapping[str, Sequence[float]]], ...] = (
        ("admitted", "Requests admitted under the in-flight limits", admission.admitted),
        ("shed", "Requests shed (429) while the model was saturated", admission.shed),
        ("waited", "Requests that waited in the queue (admitted or not)", admission.waited),
        ("wait_seconds", "Seconds requests spent waiting in the queue", admission.wait_seconds),
    )
    for family, help_text, counts in families:
        metric = CounterMetricFamily(
            f"controlpanel_router_class_{family}", f"{help_text}, by model and priority class.",
            labels=["model", "class"],
        )  # fmt: skip
        for model, per_rank in counts.items():
            for rank, value in enumerate(per_rank):
                if value:
                    metric.add_metric([model, PRIORITIES[rank]], value)
        yield metric
    capped = CounterMetricFamily(
        "controlpanel_router_priority_capped",
        "Requests whose X-Priority asked above their key's class, by the class given.",
        labels=["class"],
    )
    for rank, count in app.metrics.priority_capped.items():
        capped.add_metric([PRIORITIES[rank]], count)
    yield capped
    refused = CounterMetricFamily(
        "controlpanel_router_budget_refusals",
        "Requests refused (429) because their key's token budget was used up, by period.",
        labels=["period"],
    )
    for period, count in app.gate.budgets.refusals.items():
        refused.add_metric([period], count)
    yield refused


def admission_families(app: RouterView) -> Iterator[Metric]:
    """Requests waiting for room under the in-flight limits, and those turned away (429)."""
    queued = GaugeMetricFamily(
        "controlpanel_router_queued",
        "Requests waiting for room under the in-flight limits, by model.",
        labels=["model"],
    )
    for model, count in app.admission.queued().items():
        queued.add_metric([model], count)
    yield queued
    rejected = CounterMetricFamily(
        "controlpanel_router_admission_rejected",
        "Requests answered 429 because the queue was full or the wait ran out, by model.",
        labels=["model"],
    )
    for model, count in app.admission.rejected.items():
        rejected.add_metric([model], count)
    yield rejected
