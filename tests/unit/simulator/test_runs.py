"""simulator.runs: vLLM 0.32's length rules, jobs made by them, whole runs side by side."""

from __future__ import annotations

import asyncio

import pytest

from simulator.config import SimConfig
from simulator.engine import Simulator
from simulator.runs import checked_length, make_job, run_whole
from simulator.wire import ApiError
from tests.support.sim_app import INSTANT


def test_a_prompt_past_the_limit_is_refused_saying_at_least_when_cut_one_past() -> None:
    with pytest.raises(ApiError) as caught:
        checked_length(101, 1, 100, "max_tokens")
    assert "contains at least 101 input tokens" in caught.value.message
    assert caught.value.param == "input_tokens"
    with pytest.raises(ApiError) as caught:
        checked_length(150, 1, 100, "max_tokens")
    assert "contains 150 input tokens" in caught.value.message


def test_max_tokens_past_the_limit_is_refused_else_clamped_to_the_room_left() -> None:
    with pytest.raises(ApiError) as caught:
        checked_length(10, 101, 100, "max_completion_tokens")
    assert caught.value.param == "max_completion_tokens"
    assert caught.value.message.endswith("(parameter=max_completion_tokens, value=101)")
    assert checked_length(90, 100, 100, "max_tokens") == 10
    assert checked_length(90, 5, 100, "max_tokens") == 5
    assert checked_length(100, 5, 100, "max_tokens") == 0


def test_make_job_counts_blocks_defaults_and_spots_a_lora() -> None:
    sim = Simulator(SimConfig(**INSTANT, loras=("sql",), block_size=16, default_max_tokens=7))
    base = make_job(sim, "r", "sim-model", ["w"] * 20, None)
    assert (base.max_tokens, base.blocks, base.lora) == (7, 2, False)
    lora = make_job(sim, "r", "sql", ["w"] * 20, None, default_max=30, stream=True)
    assert (lora.max_tokens, lora.blocks, lora.lora, lora.stream) == (30, 4, True, True)


def test_run_whole_runs_jobs_side_by_side_and_frees_every_slot() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(ttft_ms=1.0, itl_ms=1.0, max_batch=2))  # each one waits
        jobs = [make_job(sim, f"r{i}", "sim-model", [f"w{i}"], 3) for i in range(5)]
        await run_whole(sim, jobs)
        assert all(j.finished and j.produced == 0 for j in jobs)  # produced moved to metrics
        assert (sim.completed, sim.running, sim.waiting, sim.held_blocks) == (5, 0, 0, 0)
        assert sim.peak_running == 2 and sim.metrics.generation_tokens == 15

    asyncio.run(scenario())
