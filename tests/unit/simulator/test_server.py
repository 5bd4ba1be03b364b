"""simulator.server: the app's routes, vLLM's --api-key guard, a started server's side channel
and KV events publisher, and a clean stop."""

from __future__ import annotations

import asyncio

import aiohttp

from simulator.config import SimConfig
from simulator.server import build_app, start_simulator
from tests.support.servers import free_port
from tests.support.sim_app import INSTANT, Served, drive


def test_an_api_key_guards_the_v1_paths_only() -> None:
    async def scenario(s: Served) -> None:
        assert (await s.get("/v1/models"))[0] == 401
        assert (await s.post("/inference/v1/generate", {}))[0] == 401
        assert (await s.get("/health"))[0] == 200 and (await s.get("/metrics"))[0] == 200
        async with s.http.get("/v1/models", headers={"Authorization": "Bearer k"}) as resp:
            assert resp.status == 200

    drive(scenario, api_key="k")


def test_every_route_vllm_serves_is_there() -> None:
    app = build_app(SimConfig())
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                 "/v1/embeddings", "/tokenize", "/detokenize", "/metrics", "/health",
                 "/inference/v1/generate", "/sim/kv_pull", "/dcgm-metrics"):  # fmt: skip
        assert path in paths, path


def test_a_started_server_names_its_port_and_publishes_kv_events_until_stopped() -> None:
    async def scenario() -> None:
        config = SimConfig(**INSTANT, kv_events_port=free_port())
        running = await start_simulator(config, "0.0.0.0")
        try:
            assert running.state.side_channel == ("127.0.0.1", running.port)
            assert running.url == f"http://0.0.0.0:{running.port}"
            assert running.state.kv_events is not None
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{running.port}/kv_event_sources"
                async with http.get(url) as resp:
                    sources = await resp.json()
            assert sources["0"]["endpoint"] == f"tcp://*:{config.kv_events_port}"
        finally:
            await running.stop()
        assert running.state.kv_events is None

    asyncio.run(scenario())


def test_a_side_channel_host_given_is_the_one_named() -> None:
    async def scenario() -> None:
        running = await start_simulator(SimConfig(**INSTANT, side_channel_host="10.1.2.3"))
        try:
            assert running.state.side_channel == ("10.1.2.3", running.port)
        finally:
            await running.stop()

    asyncio.run(scenario())
