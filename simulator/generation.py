"""The two generation endpoints, ``/v1/chat/completions`` and ``/v1/completions``: validate the
request into a :class:`~simulator.engine.Job`, let the engine admit and prefill it, then answer
whole or as an SSE stream, one token every ``itl_ms``. A disconnect cancels the job at once.

Fault injection: a ``fail_ratio`` share of valid requests is answered with vLLM's 500 error
(``fail_status``) before the engine sees it.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aiohttp import web

from simulator.engine import SIM_KEY, Job, Simulator
from simulator.responses import SSE_HEADERS, SseFrames, final_body
from simulator.tokens import parse_max_tokens, request_tokens
from simulator.wire import (
    ApiError,
    delay_s,
    error_response,
    json_response,
    parse_body,
    request_id,
    validation_error,
)

__all__ = ["chat_completions", "completions"]


def _make_job(sim: Simulator, request: web.Request, data: dict[str, Any], chat: bool) -> Job:
    cfg = sim.config
    model = sim.check_model(data.get("model"))
    tokens = request_tokens(data, chat, sim.tokenizer)
    if chat:
        raw_max = data.get("max_completion_tokens")
        raw_max = data.get("max_tokens") if raw_max is None else raw_max
    else:
        raw_max = data.get("max_tokens")
    max_tokens = parse_max_tokens(raw_max, cfg.default_max_tokens)
    param = "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens"
    max_tokens = checked_length(len(tokens), max_tokens, cfg.max_model_len, param)
    stream = bool(data.get("stream", False))
    options = data.get("stream_options")
    if options is not None and not stream:
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    blocks = -(-(len(tokens) + max_tokens) // cfg.block_size)
    rid = request_id(request, "chatcmpl" if chat else "cmpl")
    lora = model != cfg.model
    return Job(rid, model, lora, tokens, max_tokens, stream, include_usage, blocks)


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


async def _respond_whole(sim: Simulator, job: Job, chat: bool, delay: float) -> web.Response:
    loop = asyncio.get_running_loop()
    try:
        if delay:
            await asyncio.sleep(delay)
        await sim.admit(job)
        if job.max_tokens > 1 and not sim.instant and sim.config.itl_ms > 0:
            await asyncio.sleep((job.max_tokens - 1) * sim.config.itl_ms / 1000)
        job.produced = job.max_tokens
        sim.decoded(job)
        sim.complete(job, loop.time())
    except asyncio.CancelledError:
        sim.cancel(job)
        raise
    finally:
        sim.release(job)
    return json_response(final_body(job, chat))


async def _respond_stream(
    sim: Simulator, request: web.Request, job: Job, chat: bool, delay: float
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        if delay:
            await asyncio.sleep(delay)
        # Headers go out at once, as with vLLM behind uvicorn; the body starts at first token.
        await resp.prepare(request)
        await sim.admit(job)
        await _decode(sim, job, resp, SseFrames(job, chat))
        await resp.write_eof()
    except asyncio.CancelledError:
        sim.cancel(job)
        raise
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError subclasses this: the client went away mid-write.
        sim.cancel(job)
    finally:
        sim.release(job)
    return resp


async def _decode(sim: Simulator, job: Job, resp: web.StreamResponse, frames: SseFrames) -> None:
    """Write the stream; the job is counted complete just before its last frame goes out, so
    a client that has read `[DONE]` always finds it counted."""
    loop = asyncio.get_running_loop()
    itl = 0.0 if sim.instant else sim.config.itl_ms / 1000
    for i in range(job.max_tokens):
        if i and itl:
            await asyncio.sleep(itl)
        frame = frames.token(i) if i else frames.first()
        job.produced = i + 1
        sim.decoded(job)
        if job.produced == job.max_tokens:
            sim.complete(job, loop.time())
        await resp.write(frame)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    body = await sim.begin(request)
    delay = delay_s(request)
    try:
        job = _make_job(sim, request, parse_body(body), chat)
    except ApiError as exc:
        if delay:
            await asyncio.sleep(delay)
        return exc.response()
    sim.received += 1
    if sim.fail_ratio and random.random() < sim.fail_ratio:
        sim.injected_failures += 1
        return error_response(
            sim.fail_status, "injected failure (simulator fail_ratio)", "SimulatedError"
        )
    if job.stream:
        return await _respond_stream(sim, request, job, chat, delay)
    return await _respond_whole(sim, job, chat, delay)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)
