"""Running one generation :class:`~simulator.engine.Job` through the engine, for every route that
generates (chat and text completions, Anthropic's ``/v1/messages``, the batch route, the
token-in ``/inference/v1/generate``): its length checked by vLLM's rules, admitted,
prefilled, decoded one token every ``itl_ms``, then answered whole, or streamed as the
route's own :class:`Frames` write it. A disconnect cancels the job at once."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web

from simulator.engine import Job, Simulator
from simulator.responses import SSE_HEADERS
from simulator.tokens import parse_max_tokens
from simulator.wire import validation_error

__all__ = ["Frames", "checked_length", "make_job", "run_stream", "run_whole"]


class Frames(Protocol):
    """A stream's bytes: `first` at the first token, `token(i)` for each further one (the
    last one's frame ends the stream)."""

    def first(self) -> bytes: ...

    def token(self, i: int) -> bytes: ...


def checked_length(n: int, max_tokens: int, limit: int, param: str) -> int:
    """vLLM 0.32's length rules (vllm/renderers/params.py, get_max_tokens): a prompt past the
    limit is refused ("at least" when it was cut one token past it, as vLLM's tokenizer
    cuts a text), so is a `max_tokens` past the limit itself; any other `max_tokens` is
    clamped to the room the prompt leaves."""
    if n > limit:
        qualifier = "at least " if n == limit + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {qualifier}{n} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            n,
        )
    if max_tokens > limit:
        raise validation_error(
            f"{param}={max_tokens} cannot be greater than max_model_len={limit}. Please "
            "request fewer output tokens.",
            param,
            max_tokens,
        )
    return min(max_tokens, limit - n)


def make_job(
    sim: Simulator,
    rid: str,
    model: str,
    tokens: list[Any],
    raw_max: Any,
    *,
    stream: bool = False,
    include_usage: bool = False,
    param: str = "max_tokens",
    default_max: int | None = None,
) -> Job:
    """A job for `tokens`, `raw_max` checked by vLLM's length rules (absent: `default_max`,
    or the simulator's default)."""
    cfg = sim.config
    fallback = cfg.default_max_tokens if default_max is None else default_max
    max_tokens = parse_max_tokens(raw_max, fallback)
    max_tokens = checked_length(len(tokens), max_tokens, cfg.max_model_len, param)
    blocks = -(-(len(tokens) + max_tokens) // cfg.block_size)
    lora = model != cfg.model
    return Job(rid, model, lora, tokens, max_tokens, stream, include_usage, blocks)


async def run_whole(sim: Simulator, jobs: list[Job], delay: float = 0.0) -> None:
    """Run `jobs` side by side until each has all its tokens."""
    if delay:
        await asyncio.sleep(delay)
    await asyncio.gather(*(_run_one(sim, job) for job in jobs))


async def _run_one(sim: Simulator, job: Job) -> None:
    loop = asyncio.get_running_loop()
    try:
        await sim.admit(job)
        await sim.decode_tokens(job.max_tokens - 1)
        job.produced = job.max_tokens
        sim.decoded(job)
        sim.complete(job, loop.time())
    except asyncio.CancelledError:
        sim.cancel(job)
        raise
    finally:
        sim.release(job)


async def run_stream(
    sim: Simulator, request: web.Request, job: Job, frames: Frames, delay: float = 0.0
) -> web.StreamResponse:
    """Stream `job` as `frames` write it; headers at once, the body from the first token."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    loop = asyncio.get_running_loop()
    try:
        if delay:
            await asyncio.sleep(delay)
        await resp.prepare(request)
        await sim.admit(job)
        for i in range(job.max_tokens):
            if i and (delay := sim.token_delay_s()):
                await asyncio.sleep(delay)
            frame = frames.token(i) if i else frames.first()
            job.produced = i + 1
            sim.decoded(job)
            if job.produced == job.max_tokens:
                sim.complete(job, loop.time())
            await resp.write(frame)
        await resp.write_eof()
    except asyncio.CancelledError:
        sim.cancel(job)
        raise
    except ConnectionResetError:
        sim.cancel(job)
    finally:
        sim.release(job)
    return resp
