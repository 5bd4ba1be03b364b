"""simulator.metrics: histograms cumulated as Prometheus writes them, and a /metrics page that
follows the engine's live state and counters (vLLM's names, labels and arithmetic)."""

from __future__ import annotations

import asyncio

from simulator.config import SimConfig
from simulator.engine import Job, Simulator
from simulator.metrics import Histogram, render_metrics
from simulator.runs import run_whole

LABELS = 'engine="0",model_name="sim-model"'


def samples(text: str) -> dict[str, float]:
    """Every sample of a page, by its name and labels."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_a_histogram_counts_each_value_in_its_first_bucket_cumulated() -> None:
    hist = Histogram("h", "help", (0.1, 1.0))
    hist.observe(0.1)  # on a bound: in that bucket (le)
    hist.observe(0.5, times=2)
    hist.observe(7.0)
    page = samples("\n".join(hist.render('engine="0"', 'model_name="m"', 1700000000.0)))
    assert [page[f'h_bucket{{engine="0",le="{le}",model_name="m"}}'] for le in
            ("0.1", "1.0", "+Inf")] == [1, 3, 4]  # fmt: skip
    assert page['h_count{engine="0",model_name="m"}'] == 4
    assert page['h_sum{engine="0",model_name="m"}'] == 0.1 + 1.0 + 7.0
    assert page['h_created{engine="0",model_name="m"}'] == 1700000000.0


def test_the_page_follows_the_live_gauges() -> None:
    async def scenario() -> dict[str, float]:
        sim = Simulator(SimConfig(ttft_ms=0.0, itl_ms=0.0, max_batch=1, cache_blocks=4))
        running = Job("a", "sim-model", False, ["x"], 15, False, False, 1)
        await sim.admit(running)
        sim.waiting, sim.deferred = 2, 1  # as queued and pulling requests leave them
        return samples(render_metrics(sim))

    page = asyncio.run(scenario())
    assert page[f"vllm:num_requests_running{{{LABELS}}}"] == 1
    assert page[f"vllm:num_requests_waiting{{{LABELS}}}"] == 3  # capacity and deferred
    assert page[f'vllm:num_requests_waiting_by_reason{{{LABELS},reason="deferred"}}'] == 1
    assert page[f"vllm:kv_cache_usage_perc{{{LABELS}}}"] == 0.25


def test_counters_after_two_requests_sharing_a_prefix() -> None:
    async def scenario() -> str:
        sim = Simulator(SimConfig(ttft_ms=0.0, itl_ms=0.0, block_size=16))
        for name in ("a", "b"):
            tokens: list[object] = [f"w{i}" for i in range(40)]
            await run_whole(sim, [Job(name, "sim-model", False, tokens, 3, False, False, 3)])
        return render_metrics(sim)

    text = asyncio.run(scenario())
    page = samples(text)
    assert page[f"vllm:prompt_tokens_total{{{LABELS}}}"] == 80
    assert page[f"vllm:prefix_cache_hits_total{{{LABELS}}}"] == 32
    assert page[f'vllm:prompt_tokens_by_source_total{{{LABELS},source="local_compute"}}'] == 48
    assert page[f"vllm:generation_tokens_total{{{LABELS}}}"] == 6
    success = (
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"}'
    )
    assert page[success] == 2
    assert page[f"vllm:time_to_first_token_seconds_count{{{LABELS}}}"] == 2
    assert "vllm:nixl_xfer_time_seconds" not in text and "vllm:lora_requests_info" not in text
    [info] = [k for k in page if k.startswith("vllm:cache_config_info{")]
    assert 'kv_cache_size_tokens="16384"' in info and 'block_size="16"' in info


def test_a_pd_role_adds_the_nixl_families_and_a_model_name_is_escaped() -> None:
    sim = Simulator(SimConfig(role="decode", model='we"ird\\name'))
    text = render_metrics(sim)
    assert "# TYPE vllm:nixl_xfer_time_seconds histogram" in text
    assert "vllm:nixl_num_kv_expired_reqs_total{" in text
    assert 'model_name="we\\"ird\\\\name"' in text
