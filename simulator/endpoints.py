"""Every endpoint but generation: embeddings, ``/tokenize``, ``/detokenize``, ``/v1/models``,
LoRA load and unload, ``/health``, ``/ping``, ``/version``, ``/load`` (always there, as in vLLM
0.32), ``/kv_event_sources``, the Prometheus
``/metrics`` and the DCGM exporter's ``/dcgm-metrics``, and the test hooks ``/sim/stats``,
``/sim/reset`` and ``/sim/control`` (health, fault injection, a slower TTFT, GPU faults), and
``/sim/kv_pull``, where a decode simulator takes a prefill simulator's blocks
(:mod:`simulator.pd`).

The vLLM endpoints share one prologue (:func:`_api`): the request is logged, ``X-Sim-Delay-Ms``
is honoured, and an :class:`~simulator.wire.ApiError` becomes vLLM's JSON error.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from simulator.engine import SIM_KEY, Simulator
from simulator.metrics import render_metrics
from simulator.tokens import detokenize_ids, request_tokens, token_ids
from simulator.wire import ApiError, delay_s, json_response, parse_body, request_id

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _api(fn: Callable[[Simulator, web.Request, bytes], Awaitable[web.StreamResponse]]) -> Handler:
    """Wrap a handler with the common prologue: log, X-Sim-Delay-Ms, ApiError -> JSON error."""

    async def handler(request: web.Request) -> web.StreamResponse:
        sim = request.app[SIM_KEY]
        body = await sim.begin(request)
        delay = delay_s(request)
        if delay:
            await asyncio.sleep(delay)
        try:
            return await fn(sim, request, body)
        except ApiError as exc:
            return exc.response()

    return handler


def _embedding(item: Any) -> list[float]:
    raw = item.encode() if isinstance(item, str) else orjson.dumps(item)
    digest = hashlib.blake2b(raw, digest_size=64).digest()
    values = [v / 32768 for v in memoryview(digest).cast("h")]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _embedding_inputs(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value]
        if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            return value
    raise ApiError(400, "`input` must be a string, a list of strings or of token ids.", "input")


@_api
async def embeddings(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = parse_body(body)
    model = sim.check_model(data.get("model"))
    inputs = _embedding_inputs(data.get("input"))
    sim.received += 1
    rid = request_id(request, "embd")
    if not sim.instant and sim.config.ttft_ms > 0:
        try:
            await asyncio.sleep(sim.config.ttft_ms / 4000)
        except asyncio.CancelledError:
            sim.record_cancel(rid)
            raise
    sim.completed += 1
    n_tokens = sum(len(i.split()) if isinstance(i, str) else len(i) for i in inputs)
    items = [
        {"object": "embedding", "index": i, "embedding": _embedding(item)}
        for i, item in enumerate(inputs)
    ]
    usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}
    return json_response(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": items,
            "usage": usage,
        }
    )


@_api
async def tokenize(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = parse_body(body)
    sim.check_model(data.get("model"))
    ids = token_ids(request_tokens(data, "messages" in data, sim.tokenizer))
    return json_response(
        {
            "count": len(ids),
            "max_model_len": sim.config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    )


@_api
async def detokenize(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = parse_body(body)
    sim.check_model(data.get("model"))
    ids = data.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ApiError(400, "`tokens` must be a list of token ids.", "tokens")
    text = sim.tokenizer.decode(ids) if sim.tokenizer else detokenize_ids(ids)
    return json_response({"prompt": text})


def _model_card(sim: Simulator, name: str, parent: str | None) -> dict[str, Any]:
    """One /v1/models entry as vLLM writes it: an adapter's root is its path, its parent the
    base model, and its max_model_len null; the base model's root is its --model."""
    now = int(time.time())
    permission = {
        "id": f"modelperm-{os.urandom(16).hex()}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": name if parent is None else sim.lora_paths.get(name, name),
        "parent": parent,
        "max_model_len": sim.config.max_model_len if parent is None else None,
        "permission": [permission],
    }


@_api
async def models(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = [_model_card(sim, name, parent) for name, parent in sim.models.items()]
    return json_response({"object": "list", "data": data})


@_api
async def load_lora(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = parse_body(body)
    name, path = data.get("lora_name"), data.get("lora_path")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "`lora_name` is required.", "lora_name", "InvalidUserInput")
    if name in sim.models:
        raise ApiError(
            400, f"The lora adapter '{name}' has already been loaded.", None, "InvalidUserInput"
        )
    sim.models[name] = sim.config.model
    sim.lora_paths[name] = path if isinstance(path, str) and path else name
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


@_api
async def unload_lora(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    name = parse_body(body).get("lora_name")
    if not isinstance(name, str) or name == sim.config.model or name not in sim.models:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", None)
    del sim.models[name]
    sim.lora_paths.pop(name, None)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


@_api
async def health(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return web.Response(status=200 if sim.healthy else 503)


@_api
async def ping(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return web.Response(status=200 if sim.healthy else 503)


@_api
async def version(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return json_response({"version": sim.config.version})


@_api
async def load(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return json_response({"server_load": sim.running + sim.waiting})


@_api
async def kv_event_sources(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    # vLLM 0.32's: the KV events config of each data-parallel rank. Without events the
    # simulator answers {} (what vLLM answers then is not recorded in the captures).
    kv = sim.kv_events
    return json_response({"0": kv.config()} if kv is not None else {})


@_api
async def metrics(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    text = render_metrics(sim)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


@_api
async def reset_prefix_cache(sim: Simulator, request: web.Request, body: bytes) -> web.Response:
    # A vLLM dev-mode endpoint: present so router tests can check it is never exposed.
    sim.reset_prefix_cache()
    return web.Response()


async def dcgm_metrics(request: web.Request) -> web.Response:
    # Not logged with the requests: like /metrics, it is scraped, not served.
    sim = request.app[SIM_KEY]
    max_batch = sim.config.max_batch
    load = sim.running / max_batch if max_batch else 0.0
    text = sim.gpus.render(load=load, kv_usage=sim.kv_usage(), now=time.time())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def sim_stats(request: web.Request) -> web.Response:
    return json_response(request.app[SIM_KEY].stats())


async def sim_reset(request: web.Request) -> web.Response:
    request.app[SIM_KEY].reset()
    return json_response({"ok": True})


async def sim_kv_pull(request: web.Request) -> web.Response:
    """A decode simulator takes a finished prefill's blocks (simulator.pd): 200 with their
    size when this engine still holds them (and now lets them go), else 404."""
    sim = request.app[SIM_KEY]
    try:
        data = parse_body(await request.read())
    except ApiError as exc:
        return exc.response()
    rid = data.get("remote_request_id")
    lease = None
    if data.get("remote_engine_id") == sim.engine_id and isinstance(rid, str):
        lease = sim.leases.take(rid)
    if lease is None:
        return json_response({"held": False}, 404)
    return json_response({"held": True, "blocks": lease.blocks, "num_tokens": lease.num_tokens})


async def sim_control(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    try:
        data = parse_body(await request.read())
    except ApiError as exc:
        return exc.response()
    if "healthy" in data:
        sim.healthy = bool(data["healthy"])
    if "fail_ratio" in data:
        sim.fail_ratio = min(1.0, max(0.0, float(data["fail_ratio"])))
    if "extra_ttft_ms" in data:
        sim.extra_ttft_ms = max(0.0, float(data["extra_ttft_ms"]))
    if "fail_status" in data:
        sim.fail_status = int(data["fail_status"])
    sim.gpus.control(data)
    return json_response(
        {"healthy": sim.healthy, "fail_ratio": sim.fail_ratio, "extra_ttft_ms": sim.extra_ttft_ms}
    )
