"""Anthropic's Messages API as vLLM 0.32 serves it (vllm/entrypoints/anthropic/): ``POST
/v1/messages``, whole or streamed, and ``POST /v1/messages/count_tokens``.

vLLM turns the request into a chat completion (the system prompt a system message, text blocks
the content, ``tool_use`` blocks the assistant's ``tool_calls``, a user's ``tool_result``
blocks ``tool`` messages) and its answer back into Anthropic's shapes, which this writes as
vLLM does, byte for byte in field order:

* whole: ``{"id": "chatcmpl-...", "type": "message", "role": "assistant", "content": [{"type":
  "text", "text": ...}], "model", "stop_reason", "usage": {"input_tokens", "output_tokens"}}``
  (``None`` fields left out, so no ``stop_sequence``);
* streamed: ``event: <type>`` / ``data: {...}`` pairs: ``message_start`` (usage: the whole
  prompt as input, 0 output), ``content_block_start``, one ``content_block_delta`` per token,
  ``content_block_stop``, ``message_delta`` (stop reason and the final usage),
  ``message_stop``; vLLM sends no ``ping`` and no ``data: [DONE]``;
* with ``enable_prompt_tokens_details``, usage counts the cached prompt tokens apart, as
  Anthropic does: ``input_tokens`` is the prompt less ``cache_read_input_tokens`` (its
  cached tokens) and ``cache_creation_input_tokens`` (those of the full blocks it stored);
* ``count_tokens``: ``{"input_tokens": N, "context_management": {"original_input_tokens": N}}``.

Errors as vLLM's: a request its pydantic model refuses (a required field missing, malformed
JSON) gets FastAPI's validation error in the OpenAI shape (type ``"Bad Request"``, param
``body.<field>``); an error of the chat completion behind it (an unknown model, a prompt too
long) is translated to Anthropic's shape with vLLM's type name: ``{"type": "error", "error":
{"type": "NotFoundError", "message": ...}}``. The simulator stops every message at
``max_tokens``, so its stop reason is always ``"max_tokens"``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from simulator.engine import SIM_KEY, Job, Simulator
from simulator.runs import make_job, run_stream, run_whole
from simulator.tokens import WORDS_B, output_text, request_tokens
from simulator.wire import ApiError, delay_s, json_response, parse_body, request_id

__all__ = ["count_tokens", "messages", "missing_field", "to_chat_messages"]

_ROLES = ("user", "assistant", "system")


def missing_field(field: str, data: dict[str, Any]) -> ApiError:
    """FastAPI's 400 for a required field the body lacks, as vLLM words it."""
    detail = (
        f"{{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', "
        f"'input': '<dict of {len(data)} items>'}}"
    )
    return ApiError(400, f"1 validation error:\n  {detail}", f"body.{field}", "Bad Request")


def _invalid(loc: str, message: str) -> ApiError:
    detail = f"{{'type': 'value_error', 'loc': 'body.{loc}', 'msg': {message!r}}}"
    return ApiError(400, f"1 validation error:\n  {detail}", f"body.{loc}", "Bad Request")


def _anthropic_error(exc: ApiError) -> web.Response:
    """vLLM's translate_error_response: the chat completion's error in Anthropic's shape."""
    error = {"type": exc.err_type, "message": exc.message}
    return json_response({"type": "error", "error": error}, exc.status)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [b.get("text", "") for b in content if isinstance(b, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def to_chat_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages as the chat messages vLLM renders (its to_chat_completion_request),
    checked as its pydantic models check them."""
    out: list[dict[str, Any]] = []
    if (system := _text_of(data.get("system"))) != "":
        out.append({"role": "system", "content": system})
    turns = data.get("messages")
    if not isinstance(turns, list):
        raise _invalid("messages", "Input should be a valid list")
    for n, msg in enumerate(turns):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise _invalid(f"messages.{n}.role", "Input should be 'user', 'assistant' or 'system'")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
        elif isinstance(content, list):
            _convert_blocks(msg["role"], content, n, out)
        else:
            raise _invalid(f"messages.{n}.content", "Input should be a valid string or list")
    return out


def _convert_blocks(role: str, blocks: list[Any], n: int, out: list[dict[str, Any]]) -> None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append({"id": block.get("id") or "", "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            tool_id = block.get("tool_use_id") or ""
            out.append(
                {"role": "tool", "tool_call_id": tool_id, "content": _text_of(block.get("content"))}
            )
        elif kind == "tool_result":
            texts.append(f"Tool result: {block.get('content') or ''}")
        elif not isinstance(kind, str):
            raise _invalid(f"messages.{n}.content", "each block needs a `type`")
    message: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if texts or calls or role != "user":
        out.append(message)


def _tokens(sim: Simulator, data: dict[str, Any]) -> list[Any]:
    chat = {k: v for k, v in data.items() if k not in ("messages", "system")}
    chat["messages"] = to_chat_messages(data)
    return request_tokens(chat, True, sim.tokenizer)


def _usage(job: Job, block_size: int = 0) -> dict[str, int]:
    """The final usage (`block_size`: the engine's); without a block size, message_start's,
    whose first chunk carries no details yet."""
    prompt = len(job.tokens)
    if not block_size:
        return {"input_tokens": prompt, "output_tokens": 0}
    if job.cached_tokens is None:
        return {"input_tokens": prompt, "output_tokens": job.max_tokens}
    # vLLM's created_cache_tokens: the prompt tokens in the full blocks it stored anew.
    created = max(0, prompt // block_size * block_size - job.cached_tokens)
    return {
        "input_tokens": max(0, prompt - job.cached_tokens - created),
        "output_tokens": job.max_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": job.cached_tokens,
    }


def _event(kind: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + kind + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageFrames:
    """A streamed message's events, as vLLM's message_stream_converter writes them."""

    def __init__(self, job: Job, block_size: int) -> None:
        self.job = job
        self.block_size = block_size
        self.delta = b'event: content_block_delta\ndata: {"type":"content_block_delta",'
        self.delta += b'"delta":{"type":"text_delta","text":"'

    def first(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.job.id, "type": "message", "role": "assistant", "content": [],
            "model": self.job.model, "stop_reason": None, "stop_sequence": None,
            "usage": _usage(self.job),
        }  # fmt: skip
        start = _event(b"message_start", {"type": "message_start", "message": message})
        block = {"type": "text", "text": ""}
        start += _event(
            b"content_block_start",
            {"type": "content_block_start", "content_block": block, "index": 0},
        )
        return start + self.token(0)

    def token(self, i: int) -> bytes:
        frame = self.delta + WORDS_B[i % len(WORDS_B)] + b'"},"index":0}\n\n'
        if i < self.job.max_tokens - 1:
            return frame
        delta = {"stop_reason": "max_tokens", "stop_sequence": None}
        return (
            frame
            + _event(b"content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event(
                b"message_delta",
                {
                    "type": "message_delta",
                    "delta": delta,
                    "usage": _usage(self.job, self.block_size),
                },
            )
            + _event(b"message_stop", {"type": "message_stop"})
        )


def _message_job(sim: Simulator, request: web.Request, data: dict[str, Any]) -> Job:
    for field in ("model", "messages", "max_tokens"):
        if field not in data:
            raise missing_field(field, data)
    tokens = _tokens(sim, data)
    model = sim.check_model(data["model"])
    raw_max = data["max_tokens"]
    if isinstance(raw_max, int) and not isinstance(raw_max, bool) and raw_max <= 0:
        raise _invalid("max_tokens", "Value error, max_tokens must be positive")
    stream = data.get("stream") is True
    rid = request_id(request, "chatcmpl")
    return make_job(sim, rid, model, tokens, raw_max, stream=stream, include_usage=stream)


async def messages(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    body = await sim.begin(request)
    delay = delay_s(request)
    try:
        data = parse_body(body)
        try:
            job = _message_job(sim, request, data)
        except ApiError as exc:
            if exc.err_type == "Bad Request":
                raise
            return _anthropic_error(exc)
    except ApiError as exc:
        return exc.response()
    sim.received += 1
    if job.stream:
        return await run_stream(sim, request, job, MessageFrames(job, sim.config.block_size), delay)
    await run_whole(sim, [job], delay)
    answer = {
        "id": job.id, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": output_text(job.max_tokens)}],
        "model": job.model, "stop_reason": "max_tokens",
        "usage": _usage(job, sim.config.block_size),
    }  # fmt: skip
    return json_response(answer)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    body = await sim.begin(request)
    if delay := delay_s(request):
        await asyncio.sleep(delay)
    try:
        data = parse_body(body)
        for field in ("model", "messages"):
            if field not in data:
                raise missing_field(field, data)
        tokens = _tokens(sim, data)
        try:
            sim.check_model(data["model"])
        except ApiError as exc:
            return _anthropic_error(exc)
    except ApiError as exc:
        return exc.response()
    n = len(tokens)
    return json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})
