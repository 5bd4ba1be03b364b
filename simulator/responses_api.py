"""vLLM's Responses API with its store, per simulated server: ``POST /v1/responses`` (whole,
streamed, or in the background), ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

As vLLM 0.32 started with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
(vllm/entrypoints/openai/responses/serving.py): a response made with ``store`` (the
default) is kept in this server's memory, never evicted, with the conversation that led to
it, so ``previous_response_id`` continues it here and only here. An id this server does not
hold is answered with vLLM's 404, ``Response with id '<id>' not found.``, type
``invalid_request_error``, param ``response_id``: a follow-up routed to the wrong server
really fails. A whole response is stored when it finishes, a streamed one after its last
event, a background one at once (``queued``) and updated when it finishes; only a queued
or in-progress one can be cancelled. Every answer is ``max_output_tokens`` long, so its
status is ``incomplete`` (vLLM's for a ``length`` finish).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from simulator.engine import SIM_KEY, Job, Simulator
from simulator.responses import SSE_HEADERS
from simulator.tokens import WORDS_B, output_text, parse_max_tokens, request_tokens
from simulator.wire import ApiError, json_response, parse_body

__all__ = ["cancel_response", "create_response", "get_response"]


@dataclass
class Stored:
    body: dict[str, Any]
    messages: list[dict[str, str]]  # the conversation up to and with this answer
    task: asyncio.Task[None] | None = None


@dataclass
class ResponseStore:
    responses: dict[str, Stored] = field(default_factory=dict)


# One store per simulated server; kept beside it, so the shared engine stays unaware.
_stores: weakref.WeakKeyDictionary[Simulator, ResponseStore] = weakref.WeakKeyDictionary()


def store_of(sim: Simulator) -> ResponseStore:
    store = _stores.get(sim)
    if store is None:
        store = _stores[sim] = ResponseStore()
    return store


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "response_id", "invalid_request_error"
    )


def _messages(data: dict[str, Any], before: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation: the previous response's, then instructions and this input."""
    out = list(before)
    if isinstance(data.get("instructions"), str):
        out.append({"role": "system", "content": data["instructions"]})
    given = data.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list):
        raise ApiError(400, "`input` must be a string or a list of items", "input")
    for item in given:
        if not isinstance(item, dict):
            continue
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": str(item.get("role", "user")), "content": str(content or "")})
    return out


def _body(
    rid: str, model: str, data: dict[str, Any], status: str, text: str | None, usage: Any,
    max_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """ResponsesResponse as vLLM dumps it, field for field, in its order."""
    output = []
    if text is not None:
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text"}
        part["logprobs"] = None
        output.append({"id": f"msg_{uuid.uuid4().hex}", "content": [part], "role": "assistant",
                       "status": "completed", "type": "message"})  # fmt: skip
    return {
        "id": rid, "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": data.get("instructions"), "metadata": data.get("metadata"),
        "model": model, "object": "response", "output": output, "parallel_tool_calls": True,
        "temperature": data.get("temperature", 1.0), "tool_choice": data.get("tool_choice", "auto"),
        "tools": data.get("tools", []), "top_p": data.get("top_p", 1.0),
        "background": bool(data.get("background")), "max_output_tokens": max_tokens,
        "max_tool_calls": None, "previous_response_id": data.get("previous_response_id"),
        "prompt": None, "reasoning": None, "service_tier": "auto", "status": status,
        "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
        "user": data.get("user"), "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
        "output_messages": None,
    }  # fmt: skip


def _usage(job: Job) -> dict[str, Any]:
    """A finished answer's: always max_tokens long (job.produced is 0 again once the engine
    has released the job, which a whole response's is before it is saved)."""
    n = len(job.tokens)
    return {
        "input_tokens": n,
        "input_tokens_details": {"cached_tokens": job.cached_tokens or 0},
        "output_tokens": job.max_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
        "total_tokens": n + job.max_tokens,
    }


async def create_response(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    raw = await sim.begin(request)
    try:
        data = parse_body(raw)
        model = sim.check_model(data.get("model"))
        before: list[dict[str, str]] = []
        if (prev := data.get("previous_response_id")) is not None:
            found = store_of(sim).responses.get(str(prev))
            if found is None:
                raise _not_found(str(prev))
            before = found.messages
        messages = _messages(data, before)
        max_tokens = parse_max_tokens(data.get("max_output_tokens"), sim.config.default_max_tokens)
    except ApiError as exc:
        return exc.response()
    sim.received += 1
    tokens = request_tokens({"messages": messages, "model": model}, True, sim.tokenizer)
    max_tokens = max(1, min(max_tokens, sim.config.max_model_len - len(tokens)))
    rid = f"resp_{uuid.uuid4().hex}"
    blocks = -(-(len(tokens) + max_tokens) // sim.config.block_size)
    job = Job(rid, model, model != sim.config.model, tokens, max_tokens, False, False, blocks)
    keep = data.get("store", True) is not False
    run = _Run(sim, job, data, messages, max_tokens, keep)
    if data.get("background"):
        if not keep:
            message = "This vLLM engine does not support `store=False` with background mode."
            return ApiError(400, message, "background", "invalid_request_error").response()
        stored = run.save("queued", None)
        stored.task = asyncio.get_running_loop().create_task(run.in_background())
        return json_response(stored.body)
    if data.get("stream"):
        return await run.stream(request)
    return json_response(await run.whole())


@dataclass
class _Run:
    sim: Simulator
    job: Job
    data: dict[str, Any]
    messages: list[dict[str, str]]
    max_tokens: int
    keep: bool

    def body(self, status: str, text: str | None) -> dict[str, Any]:
        usage = _usage(self.job) if text is not None else None
        return _body(self.job.id, self.job.model, self.data, status, text, usage, self.max_tokens)

    def save(self, status: str, text: str | None) -> Stored:
        store = store_of(self.sim).responses
        old = store.get(self.job.id)
        if old is not None and old.body["status"] == "cancelled":
            return old  # vLLM: a cancelled response is not updated
        said = [{"role": "assistant", "content": text}] if text else []
        stored = Stored(self.body(status, text), [*self.messages, *said])
        stored.task = old.task if old is not None else None
        if self.keep:
            store[self.job.id] = stored
        return stored

    async def whole(self) -> dict[str, Any]:
        sim, job = self.sim, self.job
        try:
            await sim.admit(job)
            await sim.decode_tokens(job.max_tokens - 1)
            job.produced = job.max_tokens
            sim.decoded(job)
            sim.complete(job, asyncio.get_running_loop().time())
        except asyncio.CancelledError:
            sim.cancel(job)
            raise
        finally:
            sim.release(job)
        return self.save("incomplete", output_text(job.max_tokens)).body

    async def in_background(self) -> None:
        await self.whole()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        sim, job = self.sim, self.job
        resp = web.StreamResponse(headers=SSE_HEADERS)
        seq = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal seq
            payload = orjson.dumps({**fields, "sequence_number": seq, "type": kind})
            seq += 1
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")

        try:
            await resp.prepare(request)
            started = self.body("in_progress", None)
            await event("response.created", response=started)
            await event("response.in_progress", response=started)
            await sim.admit(job)
            item = f"msg_{uuid.uuid4().hex}"
            where = {"item_id": item, "output_index": 0, "content_index": 0}
            await event("response.output_item.added", output_index=0, item={
                "id": item, "content": [], "role": "assistant", "status": "in_progress",
                "type": "message"})  # fmt: skip
            await event("response.content_part.added", **where, part={
                "annotations": [], "text": "", "type": "output_text", "logprobs": []})  # fmt: skip
            for i in range(job.max_tokens):
                if i and (delay := sim.token_delay_s()):
                    await asyncio.sleep(delay)
                job.produced = i + 1
                sim.decoded(job)
                word = WORDS_B[i % len(WORDS_B)].decode()
                await event("response.output_text.delta", **where, delta=word, logprobs=[])
            sim.complete(job, asyncio.get_running_loop().time())
            text = output_text(job.max_tokens)
            part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text"}
            part["logprobs"] = None
            await event("response.output_text.done", **where, text=text, logprobs=[])
            await event("response.content_part.done", **where, part=part)
            await event("response.output_item.done", output_index=0, item={
                "id": item, "content": [part], "role": "assistant", "status": "completed",
                "type": "message"})  # fmt: skip
            done = self.save("incomplete", text).body
            await event("response.completed", response=done)
            await resp.write_eof()
        except asyncio.CancelledError:
            sim.cancel(job)
            raise
        except ConnectionResetError:
            sim.cancel(job)
        finally:
            sim.release(job)
        return resp


async def get_response(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    await sim.begin(request)
    rid = request.match_info["response_id"]
    found = store_of(sim).responses.get(rid)
    if found is None:
        return _not_found(rid).response()
    return json_response(found.body)


async def cancel_response(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    await sim.begin(request)
    rid = request.match_info["response_id"]
    found = store_of(sim).responses.get(rid)
    if found is None:
        return _not_found(rid).response()
    if found.body["status"] not in ("queued", "in_progress"):
        return ApiError(
            400, "Cannot cancel a synchronous response.", "response_id", "invalid_request_error"
        ).response()
    found.body["status"] = "cancelled"
    if found.task is not None:
        found.task.cancel()
    return json_response(found.body)
