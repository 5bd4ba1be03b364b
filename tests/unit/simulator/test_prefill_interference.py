"""The simulator's prefill interference (simulator.engine, ``prefill_interference_ms_per_block``),
in process: while a long prompt prefills on an engine, another request's decode tokens come
slower there, by the configured ms per prefilling block; off (the default), they do not."""

from __future__ import annotations

import asyncio
import time

from simulator.config import SimConfig
from simulator.engine import Job, Simulator

ITL_MS = 10.0
LONG_BLOCKS = 64  # the long prompt: 64 full blocks of 16 words, none cached


def _job(name: str, words: int) -> Job:
    tokens = [f"{name}{i}" for i in range(words)]
    blocks = -(-(words + 8) // 16)
    return Job(name, "sim-model", False, list(tokens), 8, True, False, blocks)


async def _decode_gap_during_long_prefill(per_block_ms: float) -> tuple[float, float, float]:
    """(the delay an engine gives a decode token before, during and after a long prefill),
    and checks a measured 5-token decode matches the delay during it."""
    config = SimConfig(
        ttft_ms=0.0,
        prefill_ms_per_block=5.0,
        itl_ms=ITL_MS,
        max_batch=4,
        prefill_interference_ms_per_block=per_block_ms,
    )
    sim = Simulator(config)
    chat = _job("chat", 8)
    await sim.admit(chat)  # a short prompt: no full block, so no prefill time
    before = sim.token_delay_s()
    long = asyncio.create_task(sim.admit(_job("long", 16 * LONG_BLOCKS)))  # 320 ms
    await asyncio.sleep(0.02)
    during = sim.token_delay_s()
    t0 = time.monotonic()
    await sim.decode_tokens(5)
    measured = (time.monotonic() - t0) / 5
    assert measured >= during * 0.95
    await long
    return before, during, sim.token_delay_s()


def test_a_long_prefill_slows_the_decodes_on_its_engine_when_on() -> None:
    before, during, after = asyncio.run(_decode_gap_during_long_prefill(0.5))
    assert before == after == ITL_MS / 1000
    assert during == (ITL_MS + 0.5 * LONG_BLOCKS) / 1000  # 10 ms + 32 ms


def test_off_by_default_the_decodes_keep_their_pace() -> None:
    assert SimConfig().prefill_interference_ms_per_block == 0
    before, during, after = asyncio.run(_decode_gap_during_long_prefill(0.0))
    assert before == during == after == ITL_MS / 1000
