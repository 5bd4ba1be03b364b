"""routing.prompt.tokenize_remote: the worker's hop for token ids, vLLM's render routes first, then
/tokenize, against a small aiohttp server answering as vLLM 0.32 does (with and without
--enable-scale-out), through real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from bench.common.workers import worker_view
from routing.prompt.tokenize_remote import RENDER_RETRY_S, RemoteTokens

SCALE_OUT_OFF = {
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with "
        "--enable-scale-out to enable them.",
        "type": "PermissionDeniedError", "param": None, "code": 403,
    }
}  # fmt: skip


class FakeVllm:
    """Render routes answering `render_status`; /tokenize always there. Counts each call."""

    def __init__(self) -> None:
        self.render_status = 200
        self.calls: list[str] = []
        self.bodies: list[dict[str, Any]] = []

    async def render(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        body = await request.json()
        self.bodies.append(body)
        if self.render_status != 200:
            return web.json_response(SCALE_OUT_OFF, status=self.render_status)
        one = {"request_id": "x", "token_ids": [1, 2, 3], "model": body["model"]}
        if request.path == "/v1/completions/render":
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            return web.json_response([one] * len(prompts))
        return web.json_response(one)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        return web.json_response({"count": 2, "max_model_len": 1024, "tokens": [7, 8]})


@contextlib.asynccontextmanager
async def fake_vllm() -> AsyncIterator[tuple[FakeVllm, str]]:
    vllm = FakeVllm()
    app = web.Application()
    for path in ("/v1/chat/completions/render", "/v1/completions/render",
                 "/v1/messages/render", "/v1/responses/render"):  # fmt: skip
        app.router.add_post(path, vllm.render)
    app.router.add_post("/tokenize", vllm.tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield vllm, f"http://127.0.0.1:{port}"
    await runner.cleanup()


CHAT = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_render_answers_every_route_with_the_clients_body() -> None:
    asyncio.run(render_answers_every_route())


async def render_answers_every_route() -> None:
    async with fake_vllm() as (vllm, url):
        remote, worker = RemoteTokens(), worker_view(1, url=url)
        async with aiohttp.ClientSession() as session:
            for path, body in [
                ("/v1/chat/completions", CHAT),
                ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": CHAT["messages"]}),
                ("/v1/responses", {"model": "m", "input": "hi"}),
                ("/v1/completions", {"model": "m", "prompt": "hello"}),
            ]:
                assert await remote.of(session, worker, "m", path, body) == [1, 2, 3]
            # Two prompts make two engine inputs: no single token list.
            two = {"model": "m", "prompt": ["a", "b"]}
            assert await remote.of(session, worker, "m", "/v1/completions", two) is None
        assert "/tokenize" not in vllm.calls
        assert vllm.bodies[0] == {**CHAT, "model": "m"}  # the body as sent, the model resolved
        assert remote.via == {"m": "render"}


def test_a_worker_without_scale_out_is_asked_by_tokenize_and_remembered() -> None:
    asyncio.run(without_scale_out())


async def without_scale_out() -> None:
    async with fake_vllm() as (vllm, url):
        vllm.render_status = 403
        now = [0.0]
        remote, worker = RemoteTokens(clock=lambda: now[0]), worker_view(1, url=url)
        async with aiohttp.ClientSession() as session:
            assert await remote.of(session, worker, "m", "/v1/chat/completions", CHAT) == [7, 8]
            assert await remote.of(session, worker, "m", "/v1/chat/completions", CHAT) == [7, 8]
            # /tokenize cannot render Anthropic's messages: no tokens, never a wrong guess.
            messages = {"model": "m", "max_tokens": 5, "messages": CHAT["messages"]}
            assert await remote.of(session, worker, "m", "/v1/messages", messages) is None
            assert vllm.calls == ["/v1/chat/completions/render", "/tokenize", "/tokenize"]
            assert remote.via == {"m": "tokenize"}
            vllm.render_status, now[0] = 200, RENDER_RETRY_S  # restarted with the flag
            assert await remote.of(session, worker, "m", "/v1/chat/completions", CHAT) == [1, 2, 3]
            assert remote.via == {"m": "render"}


def test_an_error_of_the_request_itself_gives_no_tokens_and_no_second_hop() -> None:
    asyncio.run(request_error())


async def request_error() -> None:
    async with fake_vllm() as (vllm, url):
        vllm.render_status = 400  # e.g. a prompt too long: the real request will say so
        remote = RemoteTokens()
        async with aiohttp.ClientSession() as session:
            assert await remote.of(session, worker_view(1, url=url), "m", "/v1/chat/completions",
                                   CHAT) is None  # fmt: skip
        assert vllm.calls == ["/v1/chat/completions/render"]
