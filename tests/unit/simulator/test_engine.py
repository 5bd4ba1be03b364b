"""simulator.engine: FIFO admission within max_batch, KV blocks held and given back, prefix
hits counted in tokens, cancels, LoRA bookkeeping, the request log and reset."""

from __future__ import annotations

import asyncio

import pytest

from simulator.config import SimConfig
from simulator.engine import Job, Simulator
from simulator.runs import run_whole
from simulator.wire import ApiError
from tests.support.sim_app import INSTANT, until


def job(name: str, words: int = 4, max_tokens: int = 4, model: str = "sim-model") -> Job:
    tokens: list[object] = [f"{name}{i}" for i in range(words)]
    blocks = -(-(words + max_tokens) // 16)
    return Job(name, model, model != "sim-model", tokens, max_tokens, False, False, blocks)


def test_admission_is_fifo_within_max_batch_and_a_slot_goes_to_the_oldest_waiter() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(**INSTANT, max_batch=2))
        first, second = job("a"), job("b")
        await sim.admit(first)
        await sim.admit(second)
        order: list[str] = []

        async def wait(j: Job) -> None:
            await sim.admit(j)
            order.append(j.id)

        waiters = [asyncio.create_task(wait(job(n))) for n in ("c", "d", "e")]
        await until(lambda: sim.waiting == 3, "queued")
        assert (sim.running, sim.peak_running) == (2, 2)
        sim.release(first)
        await until(lambda: order == ["c"], "c admitted")
        sim.release(second)
        await until(lambda: order == ["c", "d"], "d admitted")
        assert (sim.running, sim.waiting) == (2, 1)
        waiters[2].cancel()  # a waiter that gives up leaves the queue
        await asyncio.gather(waiters[2], return_exceptions=True)
        assert sim.waiting == 0 and sim.running == 2

    asyncio.run(scenario())


def test_running_requests_hold_their_blocks_and_give_them_back() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(**INSTANT, cache_blocks=10))
        a, b = job("a", words=20, max_tokens=12), job("b")  # 2 blocks, 1 block
        await sim.admit(a)
        await sim.admit(b)
        assert sim.held_blocks == 3 and sim.kv_usage() == pytest.approx(0.3)
        sim.release(a)
        sim.release(a)  # safe twice
        assert sim.held_blocks == 1 and sim.running == 1
        sim.release(b)
        assert (sim.held_blocks, sim.running, sim.kv_usage()) == (0, 0, 0.0)

    asyncio.run(scenario())


def test_a_repeated_prompt_hits_the_prefix_cache_counted_in_tokens() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(**INSTANT, enable_prompt_tokens_details=True))
        words = 40  # 2 full blocks of 16, then 8 words
        first, again = job("p", words), job("p", words)
        await run_whole(sim, [first])
        await run_whole(sim, [again])
        assert (first.cached_tokens, again.cached_tokens) == (0, 32)
        m = sim.metrics
        assert (m.prefix_queries, m.prefix_hits, m.prompt_tokens) == (80, 32, 80)
        assert m.generation_tokens == 8 and m.finished["length"] == 2
        assert sim.completed == 2 and sim.metrics.ttft.count == 2

    asyncio.run(scenario())


def test_decoding_caches_the_blocks_the_answer_fills() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(**INSTANT))
        long_answer = job("d", words=10, max_tokens=40)  # 49 tokens computed: 3 full blocks
        await run_whole(sim, [long_answer])
        assert len(long_answer.hashes) == 3
        assert all(h in sim.prefix_cache for h in long_answer.hashes)

    asyncio.run(scenario())


def test_a_cancelled_request_is_recorded_once_and_not_as_a_success() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(ttft_ms=0.0, itl_ms=50.0))
        slow = job("slow", max_tokens=10_000)
        task = asyncio.create_task(run_whole(sim, [slow]))
        await until(lambda: slow.admitted, "admitted")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sim.cancel(slow)  # a second cancel is a no-op
        assert (sim.cancelled, sim.cancelled_ids, sim.completed) == (1, ["slow"], 0)
        assert sim.metrics.finished["length"] == 0 and sim.running == 0

    asyncio.run(scenario())


def test_models_loras_and_the_lora_state_series() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(**INSTANT, loras=("sql",)))
        assert sim.check_model(None) == "sim-model" and sim.check_model("sql") == "sql"
        with pytest.raises(ApiError) as caught:
            sim.check_model("other")
        assert caught.value.status == 404
        lora = job("l", model="sql")
        await sim.admit(lora)
        assert sim.lora_running["sql"] == 1
        sim.release(lora)
        assert sim.lora_running["sql"] == 0
        assert {("", "sql"), ("sql", ""), ("", "")} <= set(sim.metrics.lora_seen)

    asyncio.run(scenario())


def test_reset_clears_counters_log_and_cache_but_not_live_requests() -> None:
    async def scenario() -> None:
        sim = Simulator(SimConfig(**INSTANT))
        done, live = job("done", 40), job("live")
        await run_whole(sim, [done])
        await sim.admit(live)
        sim.reset()
        assert (sim.completed, sim.received, len(sim.prefix_cache)) == (0, 0, 0)
        assert sim.running == 1 and sim.peak_running == 1
        stats = sim.stats()
        assert stats["running"] == 1 and stats["requests"] == [] and stats["kv_leases"] == 0

    asyncio.run(scenario())
