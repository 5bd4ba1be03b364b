"""Histograms as plain bucket counts: what the request path observes into (routing.telemetry,
routing.prompt), turned into Prometheus families only at scrape time."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

from prometheus_client.core import HistogramMetricFamily


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


def histogram_family(
    name: str, documentation: str, table: Mapping[str, PlainHistogram]
) -> HistogramMetricFamily:
    """One histogram family with a `model` label, from each model's plain histogram."""
    family = HistogramMetricFamily(name, documentation, labels=["model"])
    for model, histogram in table.items():
        family.add_metric([model], histogram.cumulative(), sum_value=histogram.total)
    return family
