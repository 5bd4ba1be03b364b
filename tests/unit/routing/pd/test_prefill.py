"""The prefill leg (routing.pd.prefill) against a local aiohttp server standing in for
prefill workers (one path prefix each): the transfer parameters, a retry on another
worker, the worker's own error relayed, and the client leaving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.common.workers import worker_view
from routing.fleet.snapshot import WorkerView
from routing.pd.decode import DecodeByLoad
from routing.pd.prefill import BYPASS, PrefillLeg
from routing.policies.base import Prediction, RequestInfo
from routing.state import RouterConfig, RouterState
from tests.support.exchanges import Client, exchange

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "transfer_mode": "pull"}
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


class Workers:
    """Prefill workers behind one local server: /<name>/v1/chat/completions answers as
    `behaviour[name]` says; what each received is kept."""

    def __init__(self, behaviour: dict[str, str]) -> None:
        self.behaviour = behaviour
        self.received: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.hanging = asyncio.Event()
        self.released = asyncio.Event()  # a hanging answer's end, at the scenario's

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.received.append((name, await request.json(), dict(request.headers)))
        how = self.behaviour[name]
        if how == "busy":
            return web.json_response({"error": "busy"}, status=503)
        if how == "invalid":
            return web.json_response({"error": {"message": "bad"}}, status=400)
        if how == "no_params":
            return web.json_response({"id": "x", "choices": []})
        if how == "hang":
            self.hanging.set()
            await self.released.wait()
        return web.json_response({"id": "x", "choices": [], "kv_transfer_params": PARAMS})


Scenario = Callable[[PrefillLeg, Callable[[str], WorkerView], Workers], Awaitable[None]]


def run(behaviour: dict[str, str], scenario: Scenario) -> None:
    async def main() -> None:
        workers = Workers(behaviour)
        app = web.Application()
        app.router.add_post("/{name}/v1/chat/completions", workers.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        session = aiohttp.ClientSession()

        async def upstream() -> aiohttp.ClientSession:
            return session

        def worker(name: str) -> WorkerView:
            index = list(behaviour).index(name)  # listed first: the least KV usage
            return worker_view(
                index + 1, name=name, url=f"http://127.0.0.1:{port}/{name}", role="prefill",
                kv_cache_usage=index / 10, upstream_authorization="Bearer worker-key",
            )  # fmt: skip

        state = RouterState(RouterConfig(retries=2))
        try:
            await scenario(PrefillLeg(state, upstream), worker, workers)
        finally:
            workers.released.set()
            await session.close()
            await runner.cleanup()

    asyncio.run(main())


def request(client: Client | None = None) -> Any:
    ex = exchange(client, (b"authorization", b"Bearer client-key"), model="m",
                  request_id=b"r-1", pd={})  # fmt: skip
    ex.request = RequestInfo("m", orjson.loads(BODY), [])
    return ex


def test_the_leg_returns_the_transfer_parameters_and_sends_the_workers_own_key() -> None:
    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        ex = request()
        params = await leg.run(ex, BODY, [worker("p1")], DecodeByLoad())
        assert params == PARAMS
        (name, body, headers) = workers.received[0]
        assert name == "p1" and body["messages"][0]["content"] == "hi"
        assert headers["Authorization"] == "Bearer worker-key"  # never the client's
        assert ex.pd["prefill_worker"] == "p1" and ex.pd["prefill_attempts"] == 1
        assert ex.pd["prefill_seconds"] >= 0
        assert leg.state.inflight[1] == 0  # given back

    run({"p1": "ok"}, scenario)


def test_a_busy_worker_is_left_for_another() -> None:
    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        ex = request()
        params = await leg.run(ex, BODY, [worker("p1"), worker("p2")], DecodeByLoad())
        assert params == PARAMS
        assert [name for name, _, _ in workers.received] == ["p1", "p2"]
        assert ex.pd["prefill_worker"] == "p2" and ex.pd["prefill_attempts"] == 2
        assert leg.state.metrics.pd_prefill_failures == {("m", "status_503"): 1}

    run({"p1": "busy", "p2": "ok"}, scenario)


def test_with_every_worker_busy_the_client_gets_a_503_to_retry() -> None:
    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        client = Client()
        assert await leg.run(request(client), BODY, [worker("p1")], DecodeByLoad()) is None
        assert client.status == 503 and b"no prefill worker" in client.body

    run({"p1": "busy"}, scenario)


def test_the_workers_own_error_goes_to_the_client_as_written() -> None:
    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        client = Client()
        ex = request(client)
        assert await leg.run(ex, BODY, [worker("p1"), worker("p2")], DecodeByLoad()) is None
        assert (client.status, ex.status) == (400, 400)
        assert orjson.loads(client.body) == {"error": {"message": "bad"}}
        assert len(workers.received) == 1  # an invalid request is not tried elsewhere

    run({"p1": "invalid", "p2": "ok"}, scenario)


def test_an_answer_without_transfer_parameters_is_a_502_that_names_the_cause() -> None:
    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        client = Client()
        assert await leg.run(request(client), BODY, [worker("p1")], DecodeByLoad()) is None
        assert client.status == 502 and b"--kv-transfer-config" in client.body

    run({"p1": "no_params"}, scenario)


def test_a_client_that_leaves_cancels_the_leg_at_once() -> None:
    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        client = Client()
        ex = request(client)
        task = asyncio.create_task(leg.run(ex, BODY, [worker("p1")], DecodeByLoad()))
        await asyncio.wait_for(workers.hanging.wait(), 30)
        client.leave()
        assert await asyncio.wait_for(task, 30) is None
        assert ex.client_gone and client.sent == [] and leg.state.inflight[1] == 0

    run({"p1": "hang"}, scenario)


def test_a_worker_that_holds_nearly_all_the_prompt_is_bypassed() -> None:
    class Cached(DecodeByLoad):
        def select(self, workers: Any, request: RequestInfo, loads: Any) -> Any:
            choice = super().select(workers, request, loads)
            prediction = Prediction(request, choice.worker.id, 10_000, 0.0)
            return type(choice)(choice.worker, "prefix", prediction)

    async def scenario(leg: PrefillLeg, worker: Any, workers: Workers) -> None:
        params = await leg.run(request(), BODY, [worker("p1")], Cached(), bypass_below=256)
        assert params is BYPASS and workers.received == []

    run({"p1": "ok"}, scenario)
