"""A disaggregated model's request (routing.pd.route): the bypasses, and the exchange
turned into its decode leg after a prefill leg on a local aiohttp prefill worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.common.workers import worker_view
from routing.fleet.snapshot import ModelRoute, ServedModelInfo, build_snapshot
from routing.pd.decode import DecodeByLoad
from routing.pd.route import Disaggregation
from routing.policies import make_policy
from routing.policies.base import RequestInfo
from routing.state import RouterConfig, RouterState
from tests.support.exchanges import exchange


def prompt(words: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "word " * words}]}


def run(
    scenario: Callable[[Disaggregation, RouterState, ModelRoute], Awaitable[None]],
    *, mode: str = "pull",
) -> None:  # fmt: skip
    async def answer(request: web.Request) -> web.Response:
        params = {"remote_engine_id": "e1", "transfer_mode": mode}
        return web.json_response({"id": "x", "kv_transfer_params": params})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        session = aiohttp.ClientSession()

        async def upstream() -> aiohttp.ClientSession:
            return session

        workers = [
            worker_view(1, role="prefill", url=f"http://127.0.0.1:{port}"),
            worker_view(2, role="decode"),
        ]
        state = RouterState(RouterConfig())
        state.install(
            build_snapshot(
                workers=workers,
                served_models=[ServedModelInfo("m", pd_bypass_tokens=100)],
                generation=1,
            )
        )
        try:
            await scenario(Disaggregation(state, upstream), state, state.snapshot.routes["m"])
        finally:
            await session.close()
            await runner.cleanup()

    asyncio.run(main())


def request(payload: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    ex = exchange(None, path=path, model="m", body=orjson.dumps(payload), explain={})
    ex.request = RequestInfo("m", payload, [])
    return ex


def test_a_long_prompt_is_prefilled_and_its_exchange_becomes_the_decode_leg() -> None:
    async def scenario(pd: Disaggregation, state: RouterState, route: ModelRoute) -> None:
        payload = prompt(2000)
        ex = request(payload)
        policy = make_policy("round_robin", {})
        assert await pd.place(ex, payload, route, policy)
        body = orjson.loads(ex.body)
        assert body["kv_transfer_params"]["remote_engine_id"] == "e1"
        assert body["messages"] == payload["messages"]  # the client's bytes otherwise
        assert isinstance(ex.policy, DecodeByLoad) and ex.before_retry is None
        assert ex.pd["prefill_worker"] == "w1" and ex.explain["prefill"]["worker"] == "w1"
        assert state.metrics.pd_transfers == {"m": 1}

    run(scenario)


def test_pushed_blocks_need_a_new_prefill_leg_before_a_decode_retry() -> None:
    async def scenario(pd: Disaggregation, state: RouterState, route: ModelRoute) -> None:
        payload = prompt(2000)
        ex = request(payload)
        assert await pd.place(ex, payload, route, make_policy("round_robin", {}))
        assert ex.before_retry is not None
        assert await ex.before_retry(ex)
        assert orjson.loads(ex.body)["kv_transfer_params"]["transfer_mode"] == "push"
        assert state.metrics.pd_transfers == {"m": 2}

    run(scenario, mode="push")


def test_short_prompts_other_routes_and_a_missing_prefill_pool_bypass() -> None:
    async def scenario(pd: Disaggregation, state: RouterState, route: ModelRoute) -> None:
        policy = make_policy("round_robin", {})
        short = request(prompt(3))
        assert await pd.place(short, prompt(3), route, policy)
        assert short.pd == {"bypass": "short_prompt"} and short.explain["prefill"]
        own = {**prompt(2000), "kv_transfer_params": {"x": 1}}
        as_sent = request(own)
        assert await pd.place(as_sent, own, route, policy) and as_sent.pd is None
        other = request(prompt(2000), path="/v1/embeddings")
        assert await pd.place(other, prompt(2000), route, policy) and other.pd is None
        lone = request(prompt(2000))  # its prefill pool has no routable worker left
        assert await pd.place(lone, prompt(2000), replace(route, prefill=()), policy)
        assert lone.pd == {"bypass": "no_prefill_worker"}
        assert state.metrics.pd_bypasses == {("m", "short_prompt"): 1,
                                             ("m", "no_prefill_worker"): 1}  # fmt: skip

    run(scenario)
