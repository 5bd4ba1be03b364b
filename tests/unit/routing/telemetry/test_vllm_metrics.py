"""vLLM's own series on the router's /metrics, under their own names with a `worker` label
(routing.telemetry.vllm_metrics), in process. Scraped by the real probe and read by the real
router: tests/e2e/test_vllm_metrics.py."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from routing.fleet.snapshot import ModelEntry, WorkerView
from routing.telemetry.metrics import RouterMetrics
from routing.telemetry.vllm_metrics import (
    MAX_SAMPLES_PER_WORKER,
    SERIES_KEY,
    kept_series,
    vllm_families,
)
from tests.support.common import DATA

Families = dict[str, Any]
CAPTURES = DATA / "vllm-captures"


def view(worker_id: int, series: Any) -> WorkerView:
    return WorkerView(
        id=worker_id,
        name=f"w{worker_id}",
        url="http://127.0.0.1:1",
        state="active",
        source="operator",
        models=(ModelEntry(id="m"),),
        queue_length=None,
        last_heartbeat=None,
        routable=True,
        metrics={SERIES_KEY: series},
    )


def exported(*workers: WorkerView) -> Families:
    metrics = RouterMetrics()
    metrics.name_workers(workers)
    return {f.name: f for f in vllm_families(workers, metrics.worker_label)}


def test_a_clashing_worker_label_is_kept_as_exported_worker() -> None:
    series = {"vllm:x": ["gauge", "x", [["vllm:x", {"worker": "engine-0"}, 1.0]]]}
    (sample,) = exported(view(1, series))["vllm:x"].samples
    assert sample.labels == {"worker": "w1", "exported_worker": "engine-0"}


def test_a_family_of_another_type_on_another_worker_is_left_out() -> None:
    gauge = {"vllm:y": ["gauge", "y", [["vllm:y", {}, 1.0]]]}
    counter = {"vllm:y": ["counter", "y", [["vllm:y_total", {}, 5.0]]]}
    family = exported(view(1, gauge), view(2, counter))["vllm:y"]
    assert family.type == "gauge" and [s.labels["worker"] for s in family.samples] == ["w1"]


def test_kept_series_are_bounded_and_leave_out_foreign_and_unknown_values() -> None:
    lines = ["# TYPE vllm:small gauge", "vllm:small 1", "vllm:nan NaN", "other_metric 3"]
    lines += ["# TYPE vllm:huge gauge"]
    lines += [f'vllm:huge{{request="{i}"}} 1' for i in range(MAX_SAMPLES_PER_WORKER + 1)]
    kept = kept_series(text_string_to_metric_families("\n".join(lines) + "\n"))
    # The family too big to fit is dropped whole, an empty one too; the others stay.
    assert set(kept) == {"vllm:small"}
    assert kept["vllm:small"][2] == [["vllm:small", {}, 1.0]]


def test_a_real_vllm_page_keeps_readings_only() -> None:
    # A /metrics page of real vLLM 0.32 (tests/data/vllm-captures): its creation times are
    # left out, and of lora_requests_info, which gains a series whenever the adapters
    # running change, only the latest is kept.
    page = (CAPTURES / "metrics-tiny.txt").read_text()
    assert page.count("_created{") >= 40
    kept = kept_series(text_string_to_metric_families(page))
    assert not [name for name in kept if name.endswith("_created")]
    assert not [s for f in kept.values() for s in f[2] if s[0].endswith("_created")]
    [lora] = kept["vllm:lora_requests_info"][2]
    assert lora[1]["running_lora_adapters"] == ""  # the later of the two series captured
    assert kept["vllm:num_requests_running"][2][0][1] == {
        "engine": "0",
        "model_name": "smollm2-135m",
    }
