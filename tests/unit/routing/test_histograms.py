"""Plain histograms (routing.histograms): bucket counts on the request path, Prometheus's
cumulative buckets at scrape time."""

from __future__ import annotations

from routing.histograms import PlainHistogram, histogram_family
from tests.support.metrics import families_page, value


def test_a_value_on_a_bound_is_in_that_bounds_bucket_and_buckets_accumulate() -> None:
    histogram = PlainHistogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(seconds)
    assert histogram.counts == [2, 2, 1]
    assert histogram.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert histogram.total == 8.65


def test_one_family_carries_each_models_histogram() -> None:
    fast, slow = PlainHistogram((1.0,)), PlainHistogram((1.0,))
    fast.observe(0.5)
    slow.observe(3.0)
    page = families_page([histogram_family("x_seconds", "How long.", {"a": fast, "b": slow})])
    assert value(page, "x_seconds_bucket", model="a", le="1.0") == 1
    assert value(page, "x_seconds_bucket", model="b", le="1.0") == 0
    assert value(page, "x_seconds_count", model="b") == 1
    assert value(page, "x_seconds_sum", model="b") == 3.0
