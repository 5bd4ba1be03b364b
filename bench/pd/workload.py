"""The load of one ``bench.pd`` run: closed-loop clients through the router, seeded.

* **chat**: ``CHAT_CLIENTS`` sessions, each sending one streamed chat completion after
  another: a prompt of 30-120 words (one simulated token each; the router's estimate,
  4 characters a token, stays under the default bypass of 256) and 64-128 output tokens.
* **long**: ``LONG_CLIENTS`` clients, each sending one streamed chat completion after another
  with a prompt of 3,000-6,000 words (a document to read) and 32 output tokens.

Every prompt's words are new (a per-request prefix), so no prefix cache helps. Per request:
TTFT (send to the first chunk with content) and its inter-token gaps (between consecutive
content chunks, as they arrive at the client). Clients stop sending at ``duration``; what is
in flight then finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.common.wire import CONTENT_RE, JSON_HEADERS

CHAT_CLIENTS = 16
LONG_CLIENTS = 2
CHAT_WORDS = (30, 120)
CHAT_TOKENS = (64, 128)
LONG_WORDS = (3000, 6000)
LONG_TOKENS = 32
SEED = 28  # the number


@dataclass
class Sample:
    """One request as the client saw it (perf_counter seconds)."""

    cls: str  # "chat" or "long"
    sent: float
    chunks: list[float] = field(default_factory=list)  # content chunks' arrival times
    ok: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunks)]


def _prompt(rng: random.Random, tag: str, words: tuple[int, int]) -> str:
    n = rng.randint(*words)
    return " ".join([tag, *(f"w{rng.randrange(10_000)}" for _ in range(n - 1))])


async def _one(
    http: aiohttp.ClientSession, url: str, model: str, cls: str, prompt: str, max_tokens: int
) -> Sample:
    body = orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "stream": True,
    })  # fmt: skip
    sample = Sample(cls, time.perf_counter())
    try:
        async with http.post(url, data=body, headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}"
                await resp.read()
                return sample
            async for line in resp.content:
                if CONTENT_RE.search(line):
                    sample.chunks.append(time.perf_counter())
        sample.ok = len(sample.chunks) == max_tokens
        if not sample.ok:
            sample.error = f"{len(sample.chunks)} of {max_tokens} tokens"
    except (aiohttp.ClientError, TimeoutError) as exc:
        sample.error = type(exc).__name__
    return sample


async def run_load(
    router: str, model: str, duration: float, seed: int, tag: str
) -> tuple[list[Sample], float, float]:
    """Every client until `duration` seconds have passed; returns the samples, the start and
    the moment clients stopped sending (perf_counter)."""
    url = f"{router}/v1/chat/completions"
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    start = time.perf_counter()
    stop_at = start + duration

    async def client(cls: str, i: int) -> None:
        rng = random.Random(f"{seed}-{cls}-{i}")
        await asyncio.sleep(rng.uniform(0, 0.5))  # not all in step
        n = 0
        while time.perf_counter() < stop_at:
            n += 1
            tag = f"{tag_base}-{cls}{i}-{n}"
            if cls == "chat":
                prompt = _prompt(rng, tag, CHAT_WORDS)
                tokens = rng.randint(*CHAT_TOKENS)
            else:
                prompt, tokens = _prompt(rng, tag, LONG_WORDS), LONG_TOKENS
            samples.append(await _one(http, url, model, cls, prompt, tokens))

    tag_base = tag
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        clients = [client("chat", i) for i in range(CHAT_CLIENTS)]
        clients += [client("long", i) for i in range(LONG_CLIENTS)]
        await asyncio.gather(*clients)
    return samples, start, stop_at
