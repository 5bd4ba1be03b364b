"""vLLM's own series on the real router's /metrics (uvicorn), under their own names with a
`worker` label: scraped from simulated vLLM workers by the real probe."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet.tasks import probe_workers
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

Families = dict[str, Any]


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
    # creation times (routing.telemetry.vllm_metrics.CREATED).
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
