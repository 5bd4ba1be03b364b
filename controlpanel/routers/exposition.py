"""`GET /metrics/control-plane`: what only the registry knows, for Prometheus.

The routers' `/metrics` is the data plane's (routing.telemetry.metrics); this page adds the control
plane's state, read from the database at scrape time (a few aggregate queries, never on the
/v1 path):

* `controlpanel_rollouts{alias, state}`: rollout plans per alias by state, every state
  present (0 included), so `delta(controlpanel_rollouts{state="rolled_back"}[30m]) > 0`
  says a rollout rolled back in the last half hour.
* `controlpanel_rollout_active{alias, from_target, to_target}`: 1 while a plan of the alias
  is running, paused or rolling back.
* `controlpanel_key_requests_total{key, model}` and
  `controlpanel_key_tokens_total{key, model, kind}` (`prompt`, `completion`): usage of each
  client key by its public prefix (never the key), summed over the days kept.

Every replica answers the same page; scrape it once (one target behind the Service), not per
router pod.
"""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count, Sum
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlpanel.registry.choices import RolloutState
from controlpanel.registry.models import ACTIVE_ROLLOUT_STATES, KeyUsage, RolloutPlan
from routing.telemetry.counters import CONTENT_TYPE


class ControlPlaneCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        yield from rollout_families()
        yield from key_usage_families()


def rollout_families() -> Iterator[Metric]:
    counts = GaugeMetricFamily(
        "controlpanel_rollouts", "Rollout plans per alias, by state.", labels=["alias", "state"]
    )
    found: dict[str, dict[str, int]] = {}
    rows = (
        RolloutPlan.objects.values_list("alias__name", "state").annotate(n=Count("pk")).order_by()
    )
    for alias, state, n in rows:
        found.setdefault(alias, {})[state] = n
    for alias, states in sorted(found.items()):
        for state in RolloutState.values:
            counts.add_metric([alias, state], states.get(state, 0))
    yield counts
    active = GaugeMetricFamily(
        "controlpanel_rollout_active",
        "1 while a rollout plan of the alias is running, paused or rolling back.",
        labels=["alias", "from_target", "to_target"],
    )
    plans = RolloutPlan.objects.filter(state__in=ACTIVE_ROLLOUT_STATES)
    for alias, source, target in plans.values_list("alias__name", "from_target", "to_target"):
        active.add_metric([alias, source, target], 1)
    yield active


def key_usage_families() -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "controlpanel_key_requests",
        "Answered requests per client key (its public prefix) and model, over the days kept.",
        labels=["key", "model"],
    )
    tokens = CounterMetricFamily(
        "controlpanel_key_tokens",
        "Tokens per client key (its public prefix), model and kind, over the days kept.",
        labels=["key", "model", "kind"],
    )
    rows = (
        KeyUsage.objects.values_list("api_key__prefix", "model")
        .annotate(r=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
        .order_by()
    )
    for prefix, model, total, prompt, completion in rows:
        requests.add_metric([prefix, model], total or 0)
        tokens.add_metric([prefix, model, "prompt"], prompt or 0)
        tokens.add_metric([prefix, model, "completion"], completion or 0)
    yield requests
    yield tokens


@require_GET
def control_plane_metrics(request: HttpRequest) -> HttpResponse:
    """Open like the routers' /metrics: counts and key prefixes only, never a secret."""
    return HttpResponse(bytes(generate_latest(ControlPlaneCollector())), content_type=CONTENT_TYPE)
