"""vLLM 0.32's newer inference routes, as a server started with ``--enable-scale-out`` serves
them (vllm/entrypoints/scale_out/, openai/chat_completion/): the shapes are those a real 0.32
server answered.

* ``/v1/chat/completions/render``, ``/v1/messages/render`` and ``/v1/completions/render``
  template and tokenize without running the model: a ``GenerateRequest`` (a list of them for
  completions, one per prompt, ids suffixed ``-0``, ``-1`` when there are several) with the
  prompt's ``token_ids`` and the ``sampling_params`` the request would run with (a chat's
  ``max_tokens`` defaults to the room the prompt leaves, a completion's is left out; with
  tools, ``skip_special_tokens: false``, which a tool parser asks for);
* ``/v1/chat/completions/batch``: several conversations (``messages`` a list of lists), one
  choice each, answered whole, usage summed, ``prompt_tokens_details`` null;
* ``/inference/v1/generate``: token ids in (``token_ids``, ``sampling_params``), token ids out,
  whole or streamed (``data:`` chunks of one token each, a usage chunk with
  ``stream_options.include_usage``, then ``data: [DONE]``); ``max_tokens`` defaults to the
  room the prompt leaves.

Errors are vLLM's OpenAI-shaped ones (a missing field: FastAPI's "Bad Request"; an unknown
model: 404 ``NotFoundError``).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import orjson
from aiohttp import web

from simulator.anthropic import missing_field, to_chat_messages
from simulator.engine import SIM_KEY, Job, Simulator
from simulator.runs import make_job, run_stream, run_whole
from simulator.tokens import output_text, output_token_ids, request_tokens, token_ids
from simulator.wire import ApiError, delay_s, json_response, parse_body

__all__ = ["batch", "generate", "render_chat", "render_completions", "render_messages"]


def _rid(request: web.Request) -> str:
    return request.headers.get("X-Request-Id") or os.urandom(8).hex()


async def _prologue(request: web.Request) -> tuple[Simulator, dict[str, Any]]:
    sim = request.app[SIM_KEY]
    body = await sim.begin(request)
    if delay := delay_s(request):
        await asyncio.sleep(delay)
    return sim, parse_body(body)


def _sampling(data: dict[str, Any], max_tokens: int | None, stream: bool) -> dict[str, Any]:
    temperature = data.get("temperature")
    params: dict[str, Any] = {
        "presence_penalty": float(data.get("presence_penalty") or 0.0),
        "frequency_penalty": float(data.get("frequency_penalty") or 0.0),
        "repetition_penalty": 1.0,
        "temperature": 1.0 if temperature is None else float(temperature),
    }
    if params["temperature"] != 0.0:  # greedy sampling leaves top_p and min_p out
        params["top_p"] = float(data.get("top_p") or 1.0)
        params["min_p"] = 0.0
    if data.get("seed") is not None:
        params["seed"] = data["seed"]
    stop = data.get("stop")
    params["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    params["stop_token_ids"] = []
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    choice = data.get("tool_choice")
    if (
        data.get("tools")
        and choice != "none"
        and not (isinstance(choice, dict) and choice.get("type") == "none")
    ):
        # What the tool parser asks for (hermes, the real-vLLM tier's): its tags kept.
        params["skip_special_tokens"] = False
    params.update(output_kind=1 if stream else 2, skip_clone=True, bad_words=[])
    params["skip_reading_prefix_cache"] = False
    return params


def _generate_request(
    rid: str, ids: list[int], model: str, data: dict[str, Any], max_tokens: int | None
) -> dict[str, Any]:
    stream = data.get("stream") is True
    return {
        "request_id": rid, "token_ids": ids, "token_offsets": None, "features": None,
        "content_parts": None, "sampling_params": _sampling(data, max_tokens, stream),
        "model": model, "reasoning_ended": None, "reasoning_parser_kwargs": None,
        "return_token_ids": None, "output_mode": "tokens", "stream": stream,
        "stream_options": None, "cache_salt": None, "priority": 0,
        "kv_transfer_params": None, "ec_transfer_params": None,
    }  # fmt: skip


def _chat_render(sim: Simulator, request: web.Request, data: dict[str, Any]) -> dict[str, Any]:
    model = sim.check_model(data.get("model"))
    ids = token_ids(request_tokens(data, True, sim.tokenizer))
    raw = data.get("max_completion_tokens", data.get("max_tokens"))
    job = make_job(sim, "", model, ids, raw, default_max=sim.config.max_model_len - len(ids))
    return _generate_request(f"chatcmpl-{_rid(request)}", ids, model, data, job.max_tokens)


async def render_chat(request: web.Request) -> web.StreamResponse:
    try:
        sim, data = await _prologue(request)
        if "messages" not in data:
            raise missing_field("messages", data)
        return json_response(_chat_render(sim, request, data))
    except ApiError as exc:
        return exc.response()


async def render_messages(request: web.Request) -> web.StreamResponse:
    try:
        sim, data = await _prologue(request)
        for field in ("model", "messages", "max_tokens"):
            if field not in data:
                raise missing_field(field, data)
        chat = {**data, "messages": to_chat_messages(data)}
        return json_response(_chat_render(sim, request, chat))
    except ApiError as exc:
        return exc.response()


async def render_completions(request: web.Request) -> web.StreamResponse:
    try:
        sim, data = await _prologue(request)
        model = sim.check_model(data.get("model"))
        prompt = data.get("prompt")
        many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        prompts = prompt if many and isinstance(prompt, list) else [prompt]
        rid = f"cmpl-{_rid(request)}"
        answers = []
        for i, one in enumerate(prompts):
            ids = token_ids(request_tokens({**data, "prompt": one}, False, sim.tokenizer))
            raw = data.get("max_tokens")
            if raw is not None:
                raw = make_job(sim, "", model, ids, raw).max_tokens
            name = f"{rid}-{i}" if len(prompts) > 1 else rid
            answers.append(_generate_request(name, ids, model, data, raw))
        return json_response(answers)
    except ApiError as exc:
        return exc.response()


def _usage(jobs: list[Job], details: bool) -> dict[str, Any]:
    prompt = sum(len(job.tokens) for job in jobs)
    completion = sum(job.max_tokens for job in jobs)
    cached = sum(job.cached_tokens or 0 for job in jobs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {
            "cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None,
        } if details else None,
        "completion_tokens_details": None,
    }  # fmt: skip


def _batch_choice(i: int, job: Job) -> dict[str, Any]:
    message = {
        "role": "assistant", "content": output_text(job.max_tokens), "refusal": None,
        "annotations": None, "audio": None, "function_call": None, "reasoning": None,
    }  # fmt: skip
    return {
        "index": i, "message": message, "logprobs": None, "finish_reason": "length",
        "stop_reason": None, "token_ids": None, "routed_experts": None,
    }  # fmt: skip


async def batch(request: web.Request) -> web.StreamResponse:
    try:
        sim, data = await _prologue(request)
        if "messages" not in data:
            raise missing_field("messages", data)
        model = sim.check_model(data.get("model"))
        conversations = data["messages"]
        if not isinstance(conversations, list) or not conversations:
            raise ApiError(400, "`messages` must be a non-empty list of conversations.")
        rid = f"chatcmpl-{_rid(request)}"
        raw = data.get("max_completion_tokens", data.get("max_tokens"))
        jobs = []
        for conversation in conversations:
            tokens = request_tokens({**data, "messages": conversation}, True, sim.tokenizer)
            jobs.append(make_job(sim, rid, model, tokens, raw))
    except ApiError as exc:
        return exc.response()
    sim.received += 1
    await run_whole(sim, jobs)
    return json_response(
        {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [_batch_choice(i, job) for i, job in enumerate(jobs)],
            "service_tier": None, "system_fingerprint": f"vllm-{sim.config.version}",
            "usage": _usage(jobs, details=False), "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None,
        }
    )  # fmt: skip


class _TokenFrames:
    """A streamed generate's chunks: one token each, the last with its finish reason."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.ids = output_token_ids(job.max_tokens)
        self.head = b'data: {"request_id":' + orjson.dumps(job.id)
        self.head += b',"usage":null,"output_mode":"tokens","choices":[{"index":0,'

    def first(self) -> bytes:
        return self.token(0)

    def token(self, i: int) -> bytes:
        last = i == self.job.max_tokens - 1
        versions = b'[{"version":"default","start":0,"end":%d}]' % self.job.max_tokens
        frame = self.head + b'"finish_reason":' + (b'"length"' if last else b"null")
        frame += b',"stop_reason":null,"token_ids":[%d],' % self.ids[i]
        frame += b'"routed_experts":null,"sampling_mask":null,"weight_versions":'
        frame += (versions if last else b"null") + b',"logprobs":null}]}\n\n'
        if not last:
            return frame
        if self.job.include_usage:
            usage = _usage([self.job], details=self.job.cached_tokens is not None)
            usage = {k: v for k, v in usage.items() if v is not None}
            if details := usage.get("prompt_tokens_details"):
                usage["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
            chunk = {"request_id": self.job.id, "usage": usage, "output_mode": "tokens"}
            frame += b"data: " + orjson.dumps({**chunk, "choices": []}) + b"\n\n"
        return frame + b"data: [DONE]\n\n"


def _generate_job(sim: Simulator, request: web.Request, data: dict[str, Any]) -> Job:
    for field in ("token_ids", "sampling_params"):
        if field not in data:
            raise missing_field(field, data)
    ids, params = data["token_ids"], data["sampling_params"]
    if not isinstance(ids, list) or not ids:
        raise ApiError(
            400, "`token_ids` must be a non-empty list.", "body.token_ids", "Bad Request"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        message = "token_ids must not contain negative values"
        raise ApiError(400, message, "body.token_ids", "Bad Request")
    if not isinstance(params, dict):
        raise ApiError(400, "`sampling_params` must be an object.", "body.sampling_params")
    model = sim.check_model(data.get("model"))
    options = data.get("stream_options")
    stream = data.get("stream") is True
    usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    return make_job(
        sim, f"generate-tokens-{_rid(request)}", model, list(ids), params.get("max_tokens"),
        stream=stream, include_usage=usage, default_max=sim.config.max_model_len - len(ids),
    )  # fmt: skip


async def generate(request: web.Request) -> web.StreamResponse:
    try:
        sim, data = await _prologue(request)
        job = _generate_job(sim, request, data)
    except ApiError as exc:
        return exc.response()
    sim.received += 1
    if job.stream:
        return await run_stream(sim, request, job, _TokenFrames(job))
    await run_whole(sim, [job])
    details = job.cached_tokens is not None
    choice = {
        "index": 0, "finish_reason": "length", "stop_reason": None,
        "token_ids": output_token_ids(job.max_tokens), "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": [{"version": "default", "start": 0, "end": job.max_tokens}],
        "logprobs": None,
    }  # fmt: skip
    return json_response(
        {
            "request_id": job.id, "model": job.model, "created": int(time.time()),
            "usage": _usage([job], details), "prompt_logprobs": None,
            "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "output_mode": "tokens", "choices": [choice],
        }
    )  # fmt: skip
