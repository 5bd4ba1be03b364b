"""A gentle demo client: a few chat requests per second through the router, so a demo
fleet shows moving queues and in-flight counts. Used by `manage.py serve --demo`.

It asks the router which models exist, then sends streamed and plain chat completions of
random length to random models (base models and LoRA adapters alike), at a bounded rate
with bounded concurrency, until it is stopped. It only ever talks to the given URL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal

import aiohttp
import orjson

PROMPTS = [
    "Summarise the plot of a detective story in three sentences.",
    "Write a SQL query that lists the ten most recent orders.",
    "Explain KV-cache reuse to a new engineer.",
    "Translate 'good morning, how are you?' into French and German.",
]
MAX_CONCURRENCY = 16


async def send_one(session: aiohttp.ClientSession, url: str, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
        "max_tokens": random.randint(8, 96),
        "stream": random.random() < 0.7,
    }
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.post(
            f"{url}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        ) as response:
            await response.read()


async def models(session: aiohttp.ClientSession, url: str) -> list[str]:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        async with session.get(f"{url}/v1/models") as response:
            return [m["id"] for m in (await response.json())["data"]]
    return []


async def run(url: str, rps: float, stop: asyncio.Event) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    slots = asyncio.Semaphore(MAX_CONCURRENCY)
    pending: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        known: list[str] = []
        while not stop.is_set():
            if not known or random.random() < 0.05:
                known = await models(session, url) or known
            if known and not slots.locked():
                await slots.acquire()
                task = asyncio.create_task(send_one(session, url, random.choice(known)))
                pending.add(task)
                task.add_done_callback(pending.discard)
                task.add_done_callback(lambda _: slots.release())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=random.expovariate(rps))
        for task in pending:
            task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the router's base URL")
    parser.add_argument("--rps", type=float, default=2.0)
    args = parser.parse_args()

    async def entry() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(args.url.rstrip("/"), args.rps, stop)

    asyncio.run(entry())


if __name__ == "__main__":
    main()
