"""A gentle demo client: a few chat requests per second through the router, so a demo
fleet shows moving queues and in-flight counts. Used by `manage.py serve --demo` and
`--demo-real`.

It asks the router which models exist (only those named by `--model`, when given), then
sends streamed and plain chat completions of random length to random models (base models
and LoRA adapters alike), at a bounded rate with bounded concurrency, until it is stopped.
With `--chats` it holds conversations instead: each request is the next turn of one of a
few multi-turn chats (a long system prompt shared by several of them, then the turns so far,
the model's real answers included), so a cache-aware policy has prefixes to route on and
real KV events to route them by. It only ever talks to the given URL.
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
# --chats: personas long enough to fill a few KV blocks, each shared by several chats, so a
# new chat finds its system prompt cached on the worker its persona's chats went to.
PERSONAS = [
    "You are a patient travel guide for Europe. You answer in two or three short sentences, "
    "you name one concrete place, dish or train line in every answer, and you never invent "
    "opening hours or prices. When a traveller is vague, you suggest one idea and ask one "
    "question back. You prefer trains to planes, small towns to capitals, and markets to "
    "shopping centres, and you say so when it matters to the question.",
    "You are a senior Python engineer reviewing code for a small team. You answer briefly, "
    "you explain the reason behind each suggestion, and you prefer the standard library to a "
    "new dependency. You mention tests when a change needs one, you point out the one most "
    "important problem first, and you never rewrite a whole function when a line will do. "
    "You write code in fenced blocks and keep examples under ten lines.",
    "You are a friendly science teacher for curious twelve-year-olds. You explain one idea "
    "at a time with an everyday comparison, you avoid jargon or define it in the same "
    "sentence, and you end with a small experiment that can be done at home with a glass, "
    "a torch, a balloon or a kitchen scale. You keep every answer under sixty words and you "
    "are honest when science does not know the answer yet.",
]
QUESTIONS = [
    "Where should I start?",
    "Can you give me one more example?",
    "Why is that better than the alternative?",
    "What is a common mistake here?",
    "Summarise that in one sentence.",
    "What would you do differently in winter?",
    "How do I explain this to a friend?",
]
CHATS = 6  # conversations held at once, two per persona
TURNS = 5  # a conversation starts again after this many answers


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


class Chat:
    """One multi-turn conversation: its messages so far; one turn in flight at a time."""

    def __init__(self, persona: str) -> None:
        self.persona = persona
        self.messages: list[dict[str, str]] = []
        self.busy = False
        self.restart()

    def restart(self) -> None:
        self.messages = [{"role": "system", "content": self.persona}]

    async def turn(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        """Ask the next question; keep the answer as the next assistant message (a failed
        turn is dropped, so the chat stays a well-formed alternation). The caller marks
        it busy before the task starts, so no second turn is picked meanwhile."""
        question = {"role": "user", "content": random.choice(QUESTIONS)}
        body = {
            "model": model,
            "messages": [*self.messages, question],
            "max_tokens": random.randint(16, 48),
            # a 135M model at temperature 1 rambles between languages; 0.3 stays readable
            "temperature": 0.3,
        }
        try:
            async with session.post(
                f"{url}/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
            ) as response:
                payload = orjson.loads(await response.read()) if response.status == 200 else {}
            answer = payload["choices"][0]["message"]["content"] if payload else None
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError):
            answer = None
        finally:
            self.busy = False
        if answer:
            self.messages += [question, {"role": "assistant", "content": answer}]
        if len(self.messages) > 2 * TURNS:
            self.restart()


async def models(session: aiohttp.ClientSession, url: str) -> list[str]:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        async with session.get(f"{url}/v1/models") as response:
            return [m["id"] for m in (await response.json())["data"]]
    return []


async def run(
    url: str,
    rps: float,
    stop: asyncio.Event,
    *,
    only: frozenset[str] = frozenset(),
    chats: bool = False,
    concurrency: int = MAX_CONCURRENCY,
) -> None:
    timeout = aiohttp.ClientTimeout(total=120)  # a real CPU worker can take a while
    slots = asyncio.Semaphore(concurrency)
    pending: set[asyncio.Task[None]] = set()
    held = [Chat(PERSONAS[i % len(PERSONAS)]) for i in range(CHATS)]
    async with aiohttp.ClientSession(timeout=timeout) as session:
        known: list[str] = []
        while not stop.is_set():
            if not known or random.random() < 0.05:
                listed = await models(session, url)
                known = [m for m in listed if not only or m in only] or known
            idle = [chat for chat in held if not chat.busy]
            if known and not slots.locked() and (idle or not chats):
                await slots.acquire()
                model = random.choice(known)
                if chats:
                    chat = random.choice(idle)
                    chat.busy = True
                    send = chat.turn(session, url, model)
                else:
                    send = send_one(session, url, model)
                task = asyncio.create_task(send)
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
    parser.add_argument("--model", action="append", default=[], help="only this model (repeatable)")
    parser.add_argument("--chats", action="store_true", help="multi-turn conversations")
    parser.add_argument("--concurrency", type=int, default=MAX_CONCURRENCY)
    args = parser.parse_args()

    async def entry() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(
            args.url.rstrip("/"),
            args.rps,
            stop,
            only=frozenset(args.model),
            chats=args.chats,
            concurrency=args.concurrency,
        )

    asyncio.run(entry())


if __name__ == "__main__":
    main()
