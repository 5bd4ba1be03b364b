"""The workload of ``bench.real_vllm``: seeded multi-turn chats, and the client that sends them.

A library for that script, not a script.

* **Words.** Whole-word tokens of the model's own tokenizer (``tokenizer.json``'s vocabulary:
  ``Ġ`` + 4-10 lowercase letters), so one word is about one token and a prompt's size in
  tokens is known before it is sent.
* **Conversations** (:func:`make_workload`): ``groups`` system prompts of ``system_words``
  words; ``users_per_group`` users in each group, each with ``min_turns``..``max_turns``
  user messages of ``user_words`` words (a range). The assistant's answers are the model's
  own (``max_tokens`` tokens, ``ignore_eos``, temperature 0: the tiny model's random weights
  still answer the same prompt the same way), appended to the history, so turn k+1's prompt
  extends turn k's prompt and answer.
* **Interleaving** (:func:`run_workload`): the users wait in one queue, in a seeded order;
  each of ``clients`` clients takes the first user, sends its next turn, and puts the user
  back at the end of the queue, so every user's turns are spread over the run with the
  other users' turns between them, and the caches must keep each conversation between its
  turns. Which client sends which turn depends on timing; what is sent does not.
* **Measure**: streamed chat completions with ``stream_options.include_usage``; TTFT is from
  sending to the first ``data:`` event (vLLM sends its first chunk, the role, once the first
  token exists), plus the usage's ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

WORD_RE = re.compile(r"^Ġ[a-z]{4,10}$")
# The chat template's tokens around a message: <|im_start|>, the role, "\n", <|im_end|>, "\n".
TEMPLATE_TOKENS_PER_MESSAGE = 5


@dataclass(frozen=True)
class Shape:
    """What make_workload makes (the command line's workload flags)."""

    groups: int = 8
    users_per_group: int = 2
    min_turns: int = 4
    max_turns: int = 8
    system_words: int = 600
    user_words: tuple[int, int] = (30, 60)
    max_tokens: int = 16
    seed: int = 7


@dataclass(frozen=True)
class Conversation:
    user: int
    group: int
    system: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    shape: Shape
    conversations: tuple[Conversation, ...]
    order: tuple[int, ...]  # the users' first places in the queue

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def longest_tokens(self) -> int:
        """About the longest request's prompt and answer, in tokens (words ~ tokens)."""
        per_message = TEMPLATE_TOKENS_PER_MESSAGE
        return max(
            len(c.system.split())
            + sum(len(t.split()) + self.shape.max_tokens + 2 * per_message for t in c.turns)
            + per_message
            for c in self.conversations
        )

    def distinct_blocks(self, block_size: int) -> int:
        """About how many distinct KV blocks the whole conversation set fills at its end (every
        system prompt once, every user's own history once; words ~ tokens): the size the
        two caches are sized against."""
        per_message = TEMPLATE_TOKENS_PER_MESSAGE
        systems = self.shape.groups * (self.shape.system_words + per_message)
        tails = sum(
            sum(len(t.split()) + per_message + self.shape.max_tokens + per_message for t in c.turns)
            for c in self.conversations
        )
        return (systems + tails) // block_size


def vocabulary(tokenizer_json: Path) -> list[str]:
    vocab = orjson.loads(tokenizer_json.read_bytes())["model"]["vocab"]
    return sorted(token[1:] for token in vocab if WORD_RE.match(token))


def make_workload(shape: Shape, words: list[str]) -> Workload:
    rng = random.Random(shape.seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    systems = [f"Team {g} handbook. " + text(shape.system_words) for g in range(shape.groups)]
    conversations = []
    for g in range(shape.groups):
        for u in range(shape.users_per_group):
            n_turns = rng.randint(shape.min_turns, shape.max_turns)
            turns = tuple(text(rng.randint(*shape.user_words)) for _ in range(n_turns))
            user = g * shape.users_per_group + u
            conversations.append(Conversation(user, g, systems[g], turns))
    order = list(range(len(conversations)))
    rng.shuffle(order)
    return Workload(shape, tuple(conversations), tuple(order))


@dataclass
class Sample:
    """One turn as the client saw it."""

    user: int
    turn: int
    ok: bool
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class Outcome:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0


async def one_turn(
    session: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
    max_tokens: int,
) -> tuple[Sample, str]:  # fmt: skip
    """Send one streamed turn; (its sample, the answer's text)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sample = Sample(user=-1, turn=-1, ok=False)
    parts: list[str] = []
    start = time.perf_counter()
    try:
        async with session.post(url, data=orjson.dumps(body), headers=JSON) as resp:
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return sample, ""
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if sample.ttft_s != sample.ttft_s:  # nan: the first event
                    sample.ttft_s = time.perf_counter() - start
                if line == b"data: [DONE]":
                    done = True
                    break
                read_chunk(orjson.loads(line[6:]), sample, parts)
            sample.e2e_s = time.perf_counter() - start
            sample.ok = done and not sample.error
            if not done and not sample.error:
                sample.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
    return sample, "".join(parts)


JSON = {"Content-Type": "application/json"}


def read_chunk(chunk: dict[str, Any], sample: Sample, parts: list[str]) -> None:
    if "error" in chunk:
        sample.error = str(chunk["error"])[:200]
        return
    for choice in chunk.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            parts.append(content)
    usage = chunk.get("usage")
    if usage:
        sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        sample.cached_tokens = int(details.get("cached_tokens") or 0)


async def run_workload(
    session: aiohttp.ClientSession, url: str, model: str, workload: Workload, clients: int
) -> Outcome:
    """Every conversation through `url` (…/v1/chat/completions), `clients` turns at a time."""
    queue = deque(workload.order)
    histories: dict[int, list[dict[str, str]]] = {}
    next_turn = dict.fromkeys(workload.order, 0)
    outcome = Outcome()
    remaining = [workload.requests]

    async def client() -> None:
        while remaining[0]:
            if not queue:  # every user left has a turn in flight: wait for one to come back
                await asyncio.sleep(0.005)
                continue
            user = queue.popleft()
            conv = workload.conversations[user]
            history = histories.setdefault(user, [{"role": "system", "content": conv.system}])
            turn = next_turn[user]
            history.append({"role": "user", "content": conv.turns[turn]})
            sample, answer = await one_turn(session, url, model, history, workload.shape.max_tokens)
            sample.user, sample.turn = user, turn
            outcome.samples.append(sample)
            history.append({"role": "assistant", "content": answer})
            next_turn[user] = turn + 1
            remaining[0] -= 1
            if turn + 1 < len(conv.turns):
                queue.append(user)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    outcome.wall_s = time.perf_counter() - start
    return outcome
