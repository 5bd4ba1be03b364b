"""One simulated vLLM server in this process, for the unit tests of simulator/: the aiohttp
application of simulator.server on a local port of its own, an aiohttp session on it, and
the live engine behind it, all in one asyncio.run, stopped at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

from simulator.config import SimConfig
from simulator.engine import Simulator
from simulator.server import start_simulator

T = TypeVar("T")
INSTANT = {"ttft_ms": 0.0, "itl_ms": 0.0}  # never sleeps: answers as fast as HTTP goes
CEILING_S = 60.0  # the most a condition is waited for, on however busy a machine


@dataclass
class Served:
    http: aiohttp.ClientSession  # relative paths: "/v1/models"
    sim: Simulator
    url: str

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """(status, the decoded JSON answer, or its text when it is not JSON); `body` is
        sent as JSON, or as it is when it is bytes."""
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with self.http.post(path, data=data, headers=headers) as resp:
            raw = await resp.read()
            try:
                return resp.status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                return resp.status, raw.decode()

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(path) as resp:
            raw = await resp.read()
            try:
                return resp.status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                return resp.status, raw.decode()

    async def stream(self, path: str, body: Any) -> bytes:
        async with self.http.post(path, data=orjson.dumps(body)) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()


@asynccontextmanager
async def served(config: SimConfig | None = None, **knobs: Any) -> AsyncIterator[Served]:
    """A simulator with `config`, or SimConfig(**INSTANT, **knobs)."""
    running = await start_simulator(config or SimConfig(**{**INSTANT, **knobs}))
    try:
        async with aiohttp.ClientSession(base_url=running.url) as http:
            yield Served(http, running.state, running.url)
    finally:
        await running.stop()


def drive(scenario: Callable[[Served], Awaitable[T]], **knobs: Any) -> T:
    """Run `scenario` against a fresh simulator (SimConfig(**INSTANT, **knobs))."""

    async def go() -> T:
        async with served(**knobs) as s:
            return await scenario(s)

    return asyncio.run(go())


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for `condition`, polling, up to CEILING_S (then fail, saying `what`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CEILING_S
    while not condition():
        assert loop.time() < deadline, f"still not {what} after {CEILING_S:.0f} s"
        await asyncio.sleep(0.01)


def sse_data(raw: bytes) -> list[Any]:
    """The JSON of every `data:` line of an SSE body, `[DONE]` as the string."""
    out: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out
