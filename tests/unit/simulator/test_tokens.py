"""simulator.tokens: prompts to tokens, ids stable across processes, filler output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.tokens import (
    WORDS_B,
    chat_tokens,
    detokenize_ids,
    output_text,
    output_token_ids,
    parse_max_tokens,
    prompt_tokens,
    request_tokens,
    token_id,
    token_ids,
)
from simulator.wire import ApiError
from tests.support.common import ROOT


def test_every_prompt_shape_becomes_its_tokens() -> None:
    assert prompt_tokens("a b  c") == ["a", "b", "c"]
    assert prompt_tokens(["a b", "c"]) == ["a", "b", "c"]
    assert prompt_tokens([1, 2, 3]) == [1, 2, 3]
    assert prompt_tokens([[1, 2], [3]]) == [1, 2, 3]
    for bad in (None, [], [True, False], ["a", 3], {"text": "a"}):
        with pytest.raises(ApiError) as caught:
            prompt_tokens(bad)
        assert caught.value.param == "prompt"


def test_chat_tokens_are_each_messages_role_then_its_text_parts() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}, {"type": "image"}]},
    ]
    assert chat_tokens(messages) == ["system", "be", "brief", "user", "hi", "there"]
    for bad in (None, [], ["not an object"]):
        with pytest.raises(ApiError):
            chat_tokens(bad)
    assert request_tokens({"messages": messages}, True, None) == chat_tokens(messages)
    assert request_tokens({"prompt": [7, 8]}, False, None) == [7, 8]


def test_ids_are_the_same_in_another_process_and_detokenize_back() -> None:
    ids = token_ids(["hello", "world", 42])
    assert ids[2] == 42 and all(0 < i < 150_000 for i in ids)
    code = "from simulator.tokens import token_ids; print(token_ids(['hello', 'world']))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == str(ids[:2])
    assert detokenize_ids([token_id("hello"), token_id("world"), 0]) == "hello world <unk>"


def test_output_is_the_filler_cycle_in_text_and_ids() -> None:
    assert output_text(3) == "the quick brown "
    assert output_text(21).split()[20] == "the"  # 20 words, then again from the first
    assert output_token_ids(22)[20:] == output_token_ids(2)
    assert output_token_ids(4) == token_ids(["the", "quick", "brown", "fox"])
    assert WORDS_B[1] == b"quick "


def test_max_tokens_defaults_and_refuses_non_positive_integers() -> None:
    assert parse_max_tokens(None, 16) == 16 and parse_max_tokens(5, 16) == 5
    for bad in (0, -1, 2.5, "3", True):
        with pytest.raises(ApiError):
            parse_max_tokens(bad, 16)
