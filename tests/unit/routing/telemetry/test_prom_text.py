"""The fast reader of Prometheus' text (routing.telemetry.prom_text) gives exactly what
prometheus_client's parser gives, on real vLLM 0.32 pages and on the shapes around them, and
hands back None (so the probe falls back to prometheus_client) on what it does not read."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from routing.telemetry import prom_text
from routing.telemetry.vllm_metrics import vllm_text
from tests.support.common import DATA

CAPTURE = (DATA / "vllm-captures" / "metrics-tiny.txt").read_text()


def families(found: list[Metric] | None) -> list[Any]:
    """Values by repr: NaN equals itself, and an int stays apart from a float."""
    assert found is not None
    return [(f.name, f.type, f.documentation, [sample(s) for s in f.samples]) for f in found]


def sample(s: Any) -> tuple[Any, ...]:
    return s.name, s.labels, repr(s.value), s.timestamp


def reference(text: str) -> list[Any]:
    return families(list(text_string_to_metric_families(text)))


@pytest.mark.parametrize("text", [CAPTURE, vllm_text(CAPTURE)], ids=["whole page", "vllm lines"])
def test_a_real_vllm_page_reads_as_prometheus_client_reads_it(text: str) -> None:
    found = families(prom_text.parse(text))
    assert len(found) > 30
    assert found == reference(text)


SHAPES = {
    "counter with _total": "# HELP a_total Requests.\n# TYPE a_total counter\na_total 3\n",
    "counter without _total": '# TYPE b counter\nb{x="1"} 2.5\n',
    "histogram": (
        "# HELP h Latency.\n# TYPE h histogram\n"
        'h_bucket{le="0.1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 0.3\nh_count 2\n'
    ),
    "summary": '# TYPE s summary\ns{quantile="0.5"} 1\ns_sum 2\ns_count 3\n',
    "untyped and stray samples": "loose 1\n# TYPE g gauge\ng 1\nother 2\n",
    "special values": (
        '# TYPE g gauge\ng{a="x"} NaN\ng{a="y"} +Inf\ng{a="z"} -Inf\ng{a="w"} 1e-3\n'
    ),
    "escapes": (
        "# HELP e A \\\\ back\\nslash \\t.\n# TYPE e gauge\n"
        'e{path="C:\\\\x",say="\\"hi\\"",nl="a\\nb",odd="\\t"} 1\n'
    ),
    "spacing and empty labels": '\n  # TYPE g gauge\ng{ a = "1" , b="2",} 1\ng{} 2\n\n',
    "help only": "# HELP q Only help.\nq 1\n",
    "comma inside a value": 'g{a="x,y",b="}"} 1\n',
}


@pytest.mark.parametrize("text", SHAPES.values(), ids=SHAPES.keys())
def test_each_shape_reads_as_prometheus_client_reads_it(text: str) -> None:
    assert families(prom_text.parse(text)) == reference(text)


LEFT_TO_PROMETHEUS_CLIENT = {
    "a timestamp": "g 1 1700000000000\n",
    "another comment": "# EOF\n",
    "html": "<html><body>Bad gateway</body></html>\n",
    "a value with underscores": "g 1_000\n",
    "a duplicate label": 'g{a="1",a="2"} 1\n',
    "a cut-off line": 'g{a="1" 1\n',
}


@pytest.mark.parametrize("text", LEFT_TO_PROMETHEUS_CLIENT.values(), ids=LEFT_TO_PROMETHEUS_CLIENT)
def test_what_it_does_not_read_is_left_to_prometheus_client(text: str) -> None:
    assert prom_text.parse(text) is None


def test_vllm_text_keeps_only_vllm_families_without_creation_times() -> None:
    kept = vllm_text(CAPTURE)
    names = {f.name for f in text_string_to_metric_families(kept)}
    assert names and all(n.startswith("vllm:") and not n.endswith("_created") for n in names)
    whole = {
        f.name
        for f in text_string_to_metric_families(CAPTURE)
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }
    assert names == whole
    assert vllm_text("# HELP python_gc x\npython_gc 1\n") == ""
