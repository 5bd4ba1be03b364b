"""A steady load generator for end-to-end tests: the official async OpenAI client, several
concurrent loops, streamed and whole answers alternating, every outcome recorded."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import openai


@dataclass
class Outcome:
    at: float
    ok: bool
    model: str | None = None
    error: str | None = None


@dataclass
class SteadyTraffic:
    base_url: str
    model: str
    concurrency: int = 4
    pause: float = 0.01  # between one loop's requests
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> SteadyTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def count(self) -> int:
        return len(self.outcomes)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=20
        )
        async with client:
            await asyncio.gather(*(self._loop(client, i) for i in range(self.concurrency)))

    async def _loop(self, client: openai.AsyncOpenAI, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.outcomes.append(await self._one(client, stream=(n + index) % 2 == 0))
            await asyncio.sleep(self.pause)

    async def _one(self, client: openai.AsyncOpenAI, *, stream: bool) -> Outcome:
        messages = [{"role": "user", "content": "steady traffic"}]
        try:
            if stream:
                chunks = await client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    max_tokens=4,
                    stream=True,  # type: ignore[arg-type]
                )
                models = {chunk.model async for chunk in chunks}
                model = models.pop() if len(models) == 1 else f"mixed: {models}"
            else:
                reply = await client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    max_tokens=4,  # type: ignore[arg-type]
                )
                model = reply.model
        except openai.APIError as exc:
            return Outcome(time.monotonic(), False, error=f"{type(exc).__name__}: {exc}")
        return Outcome(time.monotonic(), True, model=model)
