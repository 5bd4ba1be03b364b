"""vLLM's own series on the router's /metrics, under their own names with a `worker` label:
scraped from simulated vLLM workers by the real probe, read by the real router (uvicorn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet.tasks import probe_workers
from routing.metrics import RouterMetrics
from routing.snapshot import ModelEntry, WorkerView
from routing.vllm_metrics import MAX_SAMPLES_PER_WORKER, SERIES_KEY, kept_series, vllm_families
from tests.conftest import AddWorker, RouterServer, StartSimulator, wait_until

Families = dict[str, Any]
CAPTURES = Path(__file__).parent / "data" / "vllm-captures"


def families(text: str) -> Families:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples_of(found: Families, family: str, worker: str) -> dict[str, float]:
    return {
        s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "worker")): s.value
        for s in found[family].samples
        if s.labels.get("worker") == worker
    }


@pytest.mark.django_db(transaction=True)
def test_vllm_series_are_re_exported_with_a_worker_label(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sims = [simulator("vllm-names-m"), simulator("vllm-names-m")]
    workers = [add_worker(sim, name=f"gpu-{i + 1}") for i, sim in enumerate(sims)]
    for _ in range(3):
        body = {"model": "vllm-names-m", "prompt": "hello there", "max_tokens": 4}
        assert router.post("/v1/completions", json=body).status_code == 200
    assert probe_workers() == 2

    def scraped() -> Families | None:
        found = families(router.get("/metrics").text)
        running = found.get("vllm:num_requests_running")
        workers_seen = {s.labels.get("worker") for s in running.samples} if running else set()
        return found if {"gpu-1", "gpu-2"} <= workers_seen else None

    found = wait_until(scraped)
    direct = families(httpx.get(sims[0].url + "/metrics").text)
    # Every vLLM family the worker exports is there, with the same type and samples, bar the
    # creation times (routing.vllm_metrics.CREATED).
    vllm_names = {n for n in direct if n.startswith("vllm:") and not n.endswith("_created")}
    assert not [n for n in found if n.endswith("_created")]
    assert {"vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds", "vllm:prompt_tokens",
            "vllm:generation_tokens"} <= vllm_names  # fmt: skip
    for name in vllm_names:
        assert found[name].type == direct[name].type, name
        mine = samples_of(found, name, "gpu-1")
        theirs = {
            s.name + str(sorted(s.labels.items())): s.value
            for s in direct[name].samples
            if not s.name.endswith("_created")
        }
        assert set(mine) == set(theirs), name
    running = found["vllm:num_requests_running"].samples[0]
    assert running.labels["model_name"] == "vllm-names-m"
    # The three completions' prompts were counted, on whichever workers they went to (a
    # dict union would keep only one worker's value for the same labels).
    counted = [sum(samples_of(found, "vllm:prompt_tokens", w).values()) for w in ("gpu-1", "gpu-2")]
    assert sum(counted) > 0, counted
    # The curated gauges stay beside them.
    assert {s.labels["worker"] for s in found["controlpanel_worker_running"].samples} >= {
        w.name for w in workers
    }


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
