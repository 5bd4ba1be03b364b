"""What ``bench/overhead.py`` sends, where, and the load of one round.

A library for that script, not a script: the models and stream timing of the simulated workers,
the modes (``direct``, ``floor``, ``router``, and ``baseline`` with ``--baseline-tree``), the
scenarios (:class:`Scenario`, :func:`scenarios`), the CPU counters read around a round
(:class:`CpuSample`), and the closed-loop load generator (:func:`load_round`: ``concurrency``
clients on one aiohttp session, each sending its next request once the previous answer is read
to the end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.harness import CONTENT_RE, DONE, JSON_HEADERS, cpu_times, machine_ticks

TINY_MODEL = "bench-tiny"
STREAM_MODEL = "bench-stream"
STREAM_TOKENS = 64
STREAM_TTFT_MS = 20.0
STREAM_ITL_MS = 5.0
REQUEST_TIMEOUT_S = 60.0

# direct: straight to the workers; floor: bench/floor_proxy.py; router: controlpanel.asgi.
MODES = ("direct", "floor", "router")
# With --baseline-tree DIR: controlpanel.asgi again, from the checkout in DIR.
BASELINE = "baseline"


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    concurrency: int
    requests: int
    stream: bool

    def body(self) -> bytes:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
            "max_tokens": STREAM_TOKENS if self.stream else 1,
        }
        if self.stream:
            payload["stream"] = True
        return orjson.dumps(payload)


def scenarios(quick: bool) -> list[Scenario]:
    tiny_c1, tiny_cn, streams = (100, 400, 96) if quick else (400, 2000, 320)
    return [
        Scenario("tiny c=1", TINY_MODEL, 1, tiny_c1, stream=False),
        Scenario("tiny c=32", TINY_MODEL, 32, tiny_cn, stream=False),
        Scenario("tiny c=128", TINY_MODEL, 128, tiny_cn, stream=False),
        Scenario(f"stream {STREAM_TOKENS} tok c=32", STREAM_MODEL, 32, streams, stream=True),
    ]


# --------------------------------------------------------------------------- /proc readings


@dataclass(frozen=True)
class CpuSample:
    """CPU counters read around a round: router, floor and baseline router (user, sys),
    workers, machine, this process."""

    router_user: float
    router_sys: float
    floor_user: float
    floor_sys: float
    workers: float
    busy: int
    total: int
    client: float
    baseline_user: float = 0.0
    baseline_sys: float = 0.0

    @classmethod
    def take(
        cls, router_pid: int, floor_pid: int, worker_pids: list[int], baseline_pid: int | None
    ) -> CpuSample:
        user, system = cpu_times(router_pid)
        floor_user, floor_sys = cpu_times(floor_pid)
        base_user, base_sys = cpu_times(baseline_pid) if baseline_pid else (0.0, 0.0)
        workers = sum(sum(cpu_times(pid)) for pid in worker_pids)
        busy, total = machine_ticks()
        client = time.process_time()
        return cls(
            user, system, floor_user, floor_sys, workers, busy, total, client, base_user, base_sys
        )

    def ours(self) -> float:
        """CPU seconds of every process this benchmark runs."""
        proxies = self.router_user + self.router_sys + self.floor_user + self.floor_sys
        return proxies + self.baseline_user + self.baseline_sys + self.workers + self.client


# --------------------------------------------------------------------------- load generator


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)  # seconds
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0


async def one_plain(session: aiohttp.ClientSession, url: str, body: bytes, out: Samples) -> None:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        ok = resp.status == 200
    if ok:
        out.latencies.append(time.perf_counter() - t0)
    else:
        out.errors += 1


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, out: Samples) -> None:
    t0 = time.perf_counter()
    first = 0.0
    last = b""
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        async for chunk in resp.content.iter_any():
            if not first and CONTENT_RE.search(chunk):
                first = time.perf_counter()
            last = chunk
        ok = resp.status == 200
    if ok and first and last.endswith(DONE):
        out.latencies.append(time.perf_counter() - t0)
        out.ttfts.append(first - t0)
    else:
        out.errors += 1


async def client_loop(
    session: aiohttp.ClientSession, urls: list[str], sc: Scenario, todo: Iterator[int], out: Samples
) -> None:
    """One closed-loop client; all clients share `todo`, so exactly sc.requests are sent."""
    send = one_stream if sc.stream else one_plain
    body = sc.body()
    for i in todo:
        try:
            await send(session, urls[i % len(urls)], body, out)
        except (TimeoutError, aiohttp.ClientError):
            out.errors += 1


async def load_round(urls: list[str], sc: Scenario, requests: int) -> tuple[Samples, float]:
    """Run one round; returns the samples and the wall time in seconds."""
    out = Samples()
    todo = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=sc.concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        clients = [client_loop(session, urls, sc, todo, out) for _ in range(sc.concurrency)]
        await asyncio.gather(*clients)
        wall = time.perf_counter() - t0
    return out, wall
