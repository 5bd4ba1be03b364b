"""What ``bench.overhead`` sends, where, and the load of one round.

A library for that script, not a script: the models and stream timing of the simulated workers,
the modes (``direct``, ``floor``, ``router``; ``baseline`` with ``--baseline-tree``,
``router-granian`` with ``--granian``, and the Rust routers ``vllm-router`` and
``sglang-router`` with ``--peers``), the scenarios (:class:`Scenario`, :func:`scenarios`; the
prefix scenario's seeded long prompts, :func:`prefix_bodies`), the CPU counters read around a
round (:class:`CpuSample`), and the closed-loop load generator (:func:`load_round`:
``concurrency`` clients on one aiohttp session, each sending its next request once the
previous answer is read to the end).
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import aiohttp
import orjson

from bench.common.wire import CONTENT_RE, DONE, JSON_HEADERS
from harness.procfs import cpu_times, machine_ticks

TINY_MODEL = "bench-tiny"
STREAM_MODEL = "bench-stream"
STREAM_TOKENS = 64
STREAM_TTFT_MS = 20.0
STREAM_ITL_MS = 5.0
REQUEST_TIMEOUT_S = 60.0
# The prefix scenario: a shared system prompt and a user turn of its own per prompt, in
# pseudo-words the simulator counts as one token each (4,002 tokens with the two roles, under
# its 4,096-token context with max_tokens 1); PREFIX_PROMPTS distinct bodies, sent in turn.
PREFIX_SHARED_WORDS = 3000
PREFIX_UNIQUE_WORDS = 1000
PREFIX_PROMPTS = 64
PREFIX_SEED = 29

# direct: straight to the workers; floor: bench/common/floor_proxy.py; router: controlpanel.asgi.
MODES = ("direct", "floor", "router")
# With --baseline-tree DIR: controlpanel.asgi again, from the checkout in DIR.
BASELINE = "baseline"
# With --granian: controlpanel.asgi from this checkout, served by granian instead of uvicorn.
GRANIAN = "router-granian"
# With --floor-raw: the floor proxy with a minimal httptools upstream client instead of aiohttp.
FLOOR_RAW = "floor-raw"
# With --peers: the Rust routers (harness/rust_routers.py), one instance per model, round robin.
PEERS = ("vllm-router", "sglang-router")
# Every mode, in the order of a round's rotation (those of the run, that is).
ALL_MODES = (*MODES, FLOOR_RAW, BASELINE, GRANIAN, *PEERS)


def key(mode: str) -> str:
    """The mode's prefix in the JSON's keys: "router-granian" -> "router_granian"."""
    return mode.replace("-", "_")


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    concurrency: int
    requests: int
    stream: bool
    prefix: bool = False  # long prompts sharing a prefix (prefix_bodies), not the short one

    def body(self) -> bytes:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
            "max_tokens": STREAM_TOKENS if self.stream else 1,
        }
        if self.stream:
            payload["stream"] = True
        return orjson.dumps(payload)

    def bodies(self) -> tuple[bytes, ...]:
        """What the clients send, request i the i-th modulo their number."""
        return prefix_bodies(self.model) if self.prefix else (self.body(),)


@cache
def prefix_bodies(model: str) -> tuple[bytes, ...]:
    """PREFIX_PROMPTS seeded prompts of about 4,000 words: a shared system prompt of
    PREFIX_SHARED_WORDS, then PREFIX_UNIQUE_WORDS of each prompt's own; max_tokens 1."""
    rng = random.Random(PREFIX_SEED)

    def words(n: int) -> str:
        return " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(n))

    shared = words(PREFIX_SHARED_WORDS)
    return tuple(
        orjson.dumps(
            {
                "model": model,
                "messages": [
                    {"role": "system", "content": shared},
                    {"role": "user", "content": words(PREFIX_UNIQUE_WORDS)},
                ],
                "max_tokens": 1,
            }
        )
        for _ in range(PREFIX_PROMPTS)
    )


def scenarios(quick: bool, opt_in: bool = False) -> list[Scenario]:
    """The benchmark's scenarios; with `opt_in`, also those that run only when named with
    --only (streams at c=1 and c=8: how the added TTFT moves with concurrency)."""
    tiny_c1, tiny_cn, streams, prefix = (100, 400, 96, 192) if quick else (400, 2000, 320, 800)
    chosen = [
        Scenario("tiny c=1", TINY_MODEL, 1, tiny_c1, stream=False),
        Scenario("tiny c=32", TINY_MODEL, 32, tiny_cn, stream=False),
        Scenario("tiny c=128", TINY_MODEL, 128, tiny_cn, stream=False),
        Scenario(f"stream {STREAM_TOKENS} tok c=32", STREAM_MODEL, 32, streams, stream=True),
        Scenario("prefix 4k words c=32", TINY_MODEL, 32, prefix, stream=False, prefix=True),
    ]
    if opt_in:
        chosen += [
            Scenario(f"stream {STREAM_TOKENS} tok c={c}", STREAM_MODEL, c, n, stream=True)
            for c, n in ((1, streams // 5), (8, streams // 2))
        ]
    return chosen


# --------------------------------------------------------------------------- /proc readings


def cpu_of(pids: Sequence[int]) -> tuple[float, float]:
    """(user, system) seconds summed over `pids`."""
    times = [cpu_times(pid) for pid in pids]
    return sum(t[0] for t in times), sum(t[1] for t in times)


@dataclass(frozen=True)
class CpuSample:
    """CPU counters read around a round: each proxy mode's (user, sys) seconds (the process
    tree serving the scenario's model), the rest of the benchmark's processes (workers, the
    peers' instances serving the other model), the machine's ticks and this process."""

    proxies: dict[str, tuple[float, float]]
    rest: float
    busy: int
    total: int
    client: float

    @classmethod
    def take(cls, proxies: Mapping[str, Sequence[int]], rest: Sequence[int]) -> CpuSample:
        cpu = {mode: cpu_of(pids) for mode, pids in proxies.items()}
        other = sum(cpu_of(rest))
        busy, total = machine_ticks()
        return cls(cpu, other, busy, total, time.process_time())

    def ours(self) -> float:
        """CPU seconds of every process this benchmark runs."""
        return sum(u + s for u, s in self.proxies.values()) + self.rest + self.client


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
    session: aiohttp.ClientSession,
    urls: list[str],
    sc: Scenario,
    todo: Iterator[int],
    out: Samples,
    bodies: tuple[bytes, ...],
) -> None:
    """One closed-loop client; all clients share `todo`, so exactly sc.requests are sent."""
    send = one_stream if sc.stream else one_plain
    for i in todo:
        try:
            await send(session, urls[i % len(urls)], bodies[i % len(bodies)], out)
        except (TimeoutError, aiohttp.ClientError):
            out.errors += 1


async def load_round(urls: list[str], sc: Scenario, requests: int) -> tuple[Samples, float]:
    """Run one round; returns the samples and the wall time in seconds."""
    out = Samples()
    bodies = sc.bodies()
    todo = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=sc.concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        clients = [client_loop(session, urls, sc, todo, out, bodies) for _ in range(sc.concurrency)]
        await asyncio.gather(*clients)
        wall = time.perf_counter() - t0
    return out, wall
