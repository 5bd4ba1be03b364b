"""A fake vLLM OpenAI-compatible server for demos, tests and throughput benchmarks.

It speaks vLLM's wire format (``/v1/models``, chat and text completions with SSE streaming,
Anthropic's ``/v1/messages`` (:mod:`simulator.anthropic`), the render, batch and token-in
generate routes (:mod:`simulator.scale_out`, as with vLLM's ``--enable-scale-out``),
embeddings, ``/tokenize``, ``/detokenize``, ``/health``, Prometheus ``/metrics``) without a GPU;
:mod:`simulator.engine` models the queue, the prefix cache and the timing behind it. With
``api_key`` set, every ``/v1`` path needs ``Authorization: Bearer <key>``, as vLLM's
``--api-key`` does.

Test hooks: the header ``X-Sim-Delay-Ms: N`` delays a request by N ms before anything is sent
(including the response headers), and ``/sim/stats``, ``/sim/reset`` and ``/sim/control``
expose and steer the state over HTTP; ``/sim/kv_pull`` is how a decode simulator pulls a
prefill simulator's blocks (:mod:`simulator.pd`). ``/dcgm-metrics`` serves the server's
simulated GPUs (``gpus`` of them) as NVIDIA's DCGM exporter would (:mod:`simulator.gpus`).

:func:`start_simulator` serves in the running event loop (the tests and in-process benchmarks);
:func:`run_simulator` blocks until SIGINT or SIGTERM (``python -m simulator``,
``manage.py simulate_vllm``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

import simulator.anthropic as anthropic
import simulator.endpoints as endpoints
import simulator.responses_api as responses_api
import simulator.scale_out as scale_out
from simulator.config import SimConfig
from simulator.engine import SIM_KEY, Simulator
from simulator.generation import chat_completions, completions
from simulator.kv_publisher import KvEventPublisher
from simulator.pd import PULL_PATH

__all__ = ["RunningSimulator", "build_app", "run_simulator", "start_simulator"]


_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's GUARDED_PREFIX


def _api_key_middleware(key: str) -> Any:
    """vLLM's AuthenticationMiddleware: /v1, /v2, /inference and /cohere paths need the key;
    /health, /metrics do not."""
    expected = f"Bearer {key}"

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        guarded = request.path.startswith(_GUARDED_PREFIXES)
        if guarded and request.headers.get("Authorization") != expected:
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def build_app(config: SimConfig) -> web.Application:
    """An aiohttp application serving one simulated vLLM engine."""
    middlewares = [_api_key_middleware(config.api_key)] if config.api_key else []
    app = web.Application(client_max_size=64 * 1024**2, middlewares=middlewares)
    app[SIM_KEY] = Simulator(config)
    _add_routes(app.router)
    return app


def _add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/models", endpoints.models)
    router.add_post("/v1/chat/completions", chat_completions)
    router.add_post("/v1/completions", completions)
    router.add_post("/v1/embeddings", endpoints.embeddings)
    router.add_post("/v1/responses", responses_api.create_response)
    router.add_get("/v1/responses/{response_id}", responses_api.get_response)
    router.add_post("/v1/responses/{response_id}/cancel", responses_api.cancel_response)
    router.add_post("/v1/messages", anthropic.messages)
    router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    router.add_post("/v1/messages/render", scale_out.render_messages)
    router.add_post("/v1/chat/completions/render", scale_out.render_chat)
    router.add_post("/v1/completions/render", scale_out.render_completions)
    router.add_post("/v1/chat/completions/batch", scale_out.batch)
    router.add_post("/inference/v1/generate", scale_out.generate)
    router.add_post("/tokenize", endpoints.tokenize)
    router.add_post("/detokenize", endpoints.detokenize)
    router.add_post("/v1/load_lora_adapter", endpoints.load_lora)
    router.add_post("/v1/unload_lora_adapter", endpoints.unload_lora)
    router.add_post("/reset_prefix_cache", endpoints.reset_prefix_cache)
    router.add_get("/health", endpoints.health)
    router.add_get("/ping", endpoints.ping)
    router.add_post("/ping", endpoints.ping)
    router.add_get("/version", endpoints.version)
    router.add_get("/load", endpoints.load)
    router.add_get("/kv_event_sources", endpoints.kv_event_sources)
    router.add_get("/metrics", endpoints.metrics)
    router.add_get("/dcgm-metrics", endpoints.dcgm_metrics)
    router.add_get("/sim/stats", endpoints.sim_stats)
    router.add_post("/sim/reset", endpoints.sim_reset)
    router.add_post("/sim/control", endpoints.sim_control)
    router.add_post(PULL_PATH, endpoints.sim_kv_pull)


@dataclass
class RunningSimulator:
    """A simulator listening on a port; ``state`` is its live :class:`Simulator`."""

    runner: web.AppRunner
    port: int
    url: str
    state: Simulator

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.state.close()
        if self.state.kv_events is not None:
            await self.state.kv_events.close()
            self.state.kv_events = None


async def start_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 2.0
) -> RunningSimulator:
    """Start serving in the running event loop; port 0 picks a free port."""
    app = build_app(config)
    # handler_cancellation: a client disconnect must cancel the handler, as vLLM aborts the
    # request. access_log=None: no per-request logging in benchmarks.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    # Where a prefill's blocks are pulled from (simulator.pd): this server's own port.
    named = config.side_channel_host or (host if host not in ("", "0.0.0.0", "::") else "")
    app[SIM_KEY].side_channel = (named or "127.0.0.1", bound)
    if config.kv_events_port:
        app[SIM_KEY].kv_events = KvEventPublisher(
            shown,
            config.kv_events_port,
            config.kv_events_replay_port or None,
            legacy=config.kv_events_legacy,
            buffer_steps=config.kv_events_buffer,
        )
    return RunningSimulator(runner, bound, f"http://{shown}:{bound}", app[SIM_KEY])


async def _serve(config: SimConfig, host: str, port: int) -> None:
    sim = await start_simulator(config, host, port)
    # The console's one line format (controlpanel.settings.LOG_FORMAT), as serve prints it.
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(f"{stamp} INFO simulator: simulated vLLM {config.model} on {sim.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sim.stop()


def run_simulator(config: SimConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM (blocking)."""
    asyncio.run(_serve(config, host, port))
