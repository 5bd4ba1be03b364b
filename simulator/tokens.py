"""Tokens and text: prompts become whitespace-separated words (chat: each message's role, then
its text), a word's token id is a hash of it (the same in every simulator process, as one
model's tokenizer is on every worker), and output is a deterministic cycle of filler words.
With a tokenizer folder (``--tokenizer``), prompts are that tokenizer's ids instead, chat
templates rendered as vLLM renders them (simulator.hf_tokenizer)."""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterable
from functools import lru_cache
from typing import Any

from simulator.hf_tokenizer import HfTokenizer
from simulator.wire import ApiError

_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
    "seven", "wizards", "quietly", "hum", "a", "lively", "tune", "about", "packing", "boxes",
)  # fmt: skip
WORDS_B = tuple(w.encode() + b" " for w in _WORDS)
_VOCAB_SIZE = 150_000  # about a large model's vocabulary; id 0 is <unk>
_SEEN_CAP = 1 << 16

# A word's id is a hash of the word, the same in every simulator process, as a model's
# tokenizer is the same on every worker: a router that tokenizes on one worker must find the
# same ids in every worker's KV events. Two words may share an id (rarely): that only merges
# them. The words seen are kept for /detokenize, bounded so that benchmarks with random
# prompts cannot grow memory without limit.
_seen: dict[int, str] = {}


@lru_cache(maxsize=256)
def output_text(n: int) -> str:
    """The first n filler tokens, each a word followed by a space."""
    return "".join(_WORDS[i % len(_WORDS)] + " " for i in range(n))


def output_token_ids(n: int) -> list[int]:
    """The ids of the first n generated tokens (the filler words), for the blocks decoding
    fills: the same on every engine, as a model's answer to the same prompt would be."""
    return [_OUTPUT_IDS[i % len(_OUTPUT_IDS)] for i in range(n)]


def token_id(word: str) -> int:
    tid = zlib.crc32(word.encode()) % (_VOCAB_SIZE - 1) + 1
    if len(_seen) < _SEEN_CAP:
        _seen.setdefault(tid, word)
    return tid


_OUTPUT_IDS = tuple(zlib.crc32(w.encode()) % (_VOCAB_SIZE - 1) + 1 for w in _WORDS)


def token_ids(words: Iterable[Hashable]) -> list[int]:
    """The ids of a prompt's tokens, as /tokenize answers them and the prefix cache (and its
    KV events) sees them: ints pass through, words get their vocabulary id."""
    return [w if isinstance(w, int) else token_id(str(w)) for w in words]


def detokenize_ids(ids: Iterable[int]) -> str:
    return " ".join(_seen.get(i, "<unk>") for i in ids)


def chat_tokens(messages: Any) -> list[Hashable]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list.", "messages")
    tokens: list[Hashable] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise ApiError(400, "Each message must be an object.", "messages")
        tokens.append(str(msg.get("role", "")))
        content = msg.get("content")
        if isinstance(content, str):
            tokens.extend(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    tokens.extend(str(part.get("text", "")).split())
    return tokens


def request_tokens(data: dict[str, Any], chat: bool, tokenizer: HfTokenizer | None) -> list[Any]:
    """A generation or /tokenize request's tokens: words, or the tokenizer's ids when the
    simulator has one (token ids in a prompt pass through either way)."""
    if tokenizer is None:
        return chat_tokens(data.get("messages")) if chat else prompt_tokens(data.get("prompt"))
    if chat:
        return tokenizer.chat(data)
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.prompt(prompt, data)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [t for part in prompt for t in tokenizer.prompt(part, data)]
    return prompt_tokens(prompt)


def prompt_tokens(prompt: Any) -> list[Hashable]:
    """Tokens of a completions prompt: str, list[str], list[int] or list[list[int]]."""
    if isinstance(prompt, str):
        return list(prompt.split())
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return list(prompt)
        tokens: list[Hashable] = []
        for part in prompt:
            if isinstance(part, str):
                tokens.extend(part.split())
            elif isinstance(part, list) and all(isinstance(t, int) for t in part):
                tokens.extend(part)
            else:
                break
        else:
            return tokens
    raise ApiError(400, "`prompt` must be a string, a list of strings or of token ids.", "prompt")


def parse_max_tokens(value: Any, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, "max_tokens must be an integer >= 1.", "max_tokens")
    return value
