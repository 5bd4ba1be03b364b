"""A Prometheus page as samples keyed by name and labels, and a router's /metrics scraped
until it says what is awaited."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from routing.telemetry.counters import CONTENT_TYPE
from tests.support.servers import RouterServer, wait_until

# The router's own families.
REQUESTS = "controlpanel_router_requests_total"
TTFT = "controlpanel_router_ttft_seconds"
DURATION = "controlpanel_router_request_duration_seconds"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(router: RouterServer) -> Samples:
    response = router.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def scrape_until(router: RouterServer, predicate: Callable[[Samples], bool]) -> Samples:
    """A request is recorded just after its last byte is sent: poll rather than race it."""
    found: list[Samples] = []

    def check() -> bool:
        found[:] = [scrape(router)]
        return predicate(found[0])

    wait_until(check)
    return found[0]


def families_page(families: Iterable[Metric]) -> Samples:
    """Metric families as a scrape would show them, parsed."""
    collected = list(families)

    class Families:
        def collect(self) -> list[Metric]:
            return collected

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())  # type: ignore[arg-type]
    return parse(generate_latest(registry).decode())
