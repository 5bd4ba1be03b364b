"""The two generation endpoints, ``/v1/chat/completions`` and ``/v1/completions``: validate the
request into a :class:`~simulator.engine.Job`, let the engine admit and prefill it, then answer
whole or as an SSE stream, one token every ``itl_ms``. A disconnect cancels the job at once.

With a prefill or decode ``role``, the request's ``kv_transfer_params`` steer the engine
(:mod:`simulator.pd`), and a prefill leg's answer ends with its own ``kv_transfer_params``.

Fault injection: a ``fail_ratio`` share of valid requests is answered with vLLM's 500 error
(``fail_status``) before the engine sees it, spread evenly (at 0.2, every fifth request), so
any run of requests fails at the ratio give or take one request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from simulator.engine import SIM_KEY, Job, Simulator
from simulator.responses import SseFrames, final_body
from simulator.runs import checked_length, run_stream, run_whole
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
    job = Job(rid, model, lora, tokens, max_tokens, stream, include_usage, blocks)
    job.kv_params, job.chat = data.get("kv_transfer_params"), chat
    return job


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
    if injects_failure(sim):
        sim.injected_failures += 1
        return error_response(
            sim.fail_status, "injected failure (simulator fail_ratio)", "SimulatedError"
        )
    if job.stream:
        return await run_stream(sim, request, job, SseFrames(job, chat), delay)
    await run_whole(sim, [job], delay)
    answer = final_body(job, chat)
    if job.kv_answer is not None:
        answer["kv_transfer_params"] = job.kv_answer  # a prefill leg's (simulator.pd)
    return json_response(answer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


def injects_failure(sim: Simulator) -> bool:
    """Whether this request gets the injected failure. The share is carried from request to
    request rather than drawn at random: with random draws, a router's short health window
    of ten requests at 0.2 read as 50 % about once in thirty windows, and a test of "below
    the threshold stays active" failed on a busy machine."""
    if not sim.fail_ratio:
        return False
    sim.fail_debt += sim.fail_ratio
    if sim.fail_debt < 1.0 - 1e-9:  # 0.2 added five times is 0.9999999999999999 or so
        return False
    sim.fail_debt -= 1.0
    return True
