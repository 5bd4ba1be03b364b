"""simulator.anthropic: Anthropic's Messages API as vLLM serves it: messages turned into chat
messages, whole and streamed answers, usage with cached tokens apart, vLLM's two error
shapes, and count_tokens."""

from __future__ import annotations

import orjson
import pytest

from simulator.anthropic import to_chat_messages
from simulator.tokens import output_text
from simulator.wire import ApiError
from tests.support.sim_app import Served, drive

ASK = {"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def test_blocks_become_chat_messages_as_vllm_converts_them() -> None:
    data = {
        "system": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
            ]},
        ],
    }  # fmt: skip
    assert to_chat_messages(data) == [
        {"role": "system", "content": "be\nbrief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get", "arguments": '{"city":"Oslo"}'}},
        ]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
    ]  # fmt: skip
    for bad, loc in (
        ({"messages": "hi"}, "body.messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "body.messages.0.role"),
        ({"messages": [{"role": "user", "content": 3}]}, "body.messages.0.content"),
    ):
        with pytest.raises(ApiError) as caught:
            to_chat_messages(bad)
        assert (caught.value.param, caught.value.err_type) == (loc, "Bad Request")


def test_a_whole_message_and_its_cache_aware_usage() -> None:
    async def scenario(s: Served) -> None:
        words = " ".join(f"w{i}" for i in range(40))  # with the role: 41 tokens, 2 blocks
        ask = {**ASK, "messages": [{"role": "user", "content": words}]}
        status, first = await s.post("/v1/messages", ask)
        assert status == 200 and first["stop_reason"] == "max_tokens"
        assert first["content"] == [{"type": "text", "text": output_text(3)}]
        usage = {"input_tokens": 9, "output_tokens": 3, "cache_creation_input_tokens": 32}
        assert first["usage"] == {**usage, "cache_read_input_tokens": 0}
        _, again = await s.post("/v1/messages", ask)
        assert again["usage"]["cache_read_input_tokens"] == 32
        assert again["usage"]["cache_creation_input_tokens"] == 0

    drive(scenario, enable_prompt_tokens_details=True)


def test_a_streamed_message_is_anthropics_event_sequence_without_done() -> None:
    async def scenario(s: Served) -> None:
        raw = await s.stream("/v1/messages", {**ASK, "stream": True})
        events = [e for e in raw.decode().split("\n\n") if e]
        kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
        assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                         "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
        data = [orjson.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
        assert data[0]["message"]["usage"] == {"input_tokens": 2, "output_tokens": 0}
        assert "".join(d["delta"]["text"] for d in data[2:5]) == output_text(3)
        assert data[6]["usage"] == {"input_tokens": 2, "output_tokens": 3}
        assert b"[DONE]" not in raw

    drive(scenario)


def test_errors_in_fastapis_shape_or_translated_to_anthropics() -> None:
    async def scenario(s: Served) -> None:
        status, missing = await s.post("/v1/messages", {"model": "sim-model", "messages": []})
        assert status == 400 and missing["error"]["param"] == "body.max_tokens"
        assert missing["error"]["type"] == "Bad Request"
        status, unknown = await s.post("/v1/messages", {**ASK, "model": "claude"})
        assert status == 404 and unknown["type"] == "error"
        assert unknown["error"]["type"] == "NotFoundError"
        status, zero = await s.post("/v1/messages", {**ASK, "max_tokens": 0})
        assert status == 400 and zero["error"]["param"] == "body.max_tokens"
        assert s.sim.received == 0

    drive(scenario)


def test_count_tokens_counts_the_converted_prompt() -> None:
    async def scenario(s: Served) -> None:
        body = {"model": "sim-model", "system": "be brief", "messages": ASK["messages"]}
        status, counted = await s.post("/v1/messages/count_tokens", body)
        assert status == 200
        assert counted == {"input_tokens": 5, "context_management": {"original_input_tokens": 5}}
        status, _ = await s.post("/v1/messages/count_tokens", {"model": "sim-model"})
        assert status == 400

    drive(scenario)
