"""simulator.generation: /v1/chat/completions and /v1/completions through a served app:
validation into vLLM's errors, whole and streamed answers, fault injection, a cancel."""

from __future__ import annotations

import asyncio

from simulator.tokens import output_text
from tests.support.sim_app import Served, drive, sse_data, until

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}]}


def test_a_whole_chat_answer_is_max_tokens_long_with_vllms_usage() -> None:
    async def scenario(s: Served) -> None:
        status, body = await s.post("/v1/chat/completions", {**CHAT, "max_tokens": 5})
        assert status == 200
        assert body["choices"][0]["message"]["content"] == output_text(5)
        assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5,
                                 "prompt_tokens_details": None}  # fmt: skip
        # max_completion_tokens wins over max_tokens; text completions default to 16.
        _, body = await s.post(
            "/v1/chat/completions", {**CHAT, "max_tokens": 5, "max_completion_tokens": 2}
        )
        assert body["usage"]["completion_tokens"] == 2
        _, body = await s.post("/v1/completions", {"prompt": "a b c"})
        assert body["choices"][0]["text"] == output_text(16)
        assert (s.sim.received, s.sim.completed) == (3, 3)

    drive(scenario)


def test_streams_carry_every_token_and_the_usage_chunk_when_asked() -> None:
    async def scenario(s: Served) -> None:
        body = {**CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        chunks = sse_data(await s.stream("/v1/chat/completions", body))
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 4
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2])
        assert text == output_text(4)

    drive(scenario)


def test_invalid_requests_get_vllms_errors_and_are_not_counted() -> None:
    async def scenario(s: Served) -> dict[str, tuple[int, object]]:
        cases = {
            "unknown model": {**CHAT, "model": "gpt-9"},
            "options without stream": {**CHAT, "stream_options": {"include_usage": True}},
            "past the context": {**CHAT, "max_tokens": 64},
            "no messages": {"model": "sim-model"},
        }
        out = {}
        for name, body in cases.items():
            status, answer = await s.post("/v1/chat/completions", body)
            out[name] = (status, answer["error"]["param"])
        assert s.sim.received == 0
        return out

    assert drive(scenario, max_model_len=32) == {
        "unknown model": (404, "model"),
        "options without stream": (400, "stream_options"),
        "past the context": (400, "max_tokens"),
        "no messages": (400, "messages"),
    }


def test_a_fail_ratio_of_one_answers_every_valid_request_with_the_injected_error() -> None:
    async def scenario(s: Served) -> None:
        status, body = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 500 and body["error"]["type"] == "SimulatedError"
        assert (s.sim.injected_failures, s.sim.completed) == (1, 0)
        s.sim.fail_status = 503
        assert (await s.post("/v1/completions", {"prompt": "x"}))[0] == 503

    drive(scenario, fail_ratio=1.0)


def test_a_fail_ratio_fails_exactly_that_share_spread_evenly() -> None:
    """At 0.2 every fifth request fails: no run of ten requests holds more than two
    failures, as a router's short health window would otherwise see by chance."""

    async def scenario(s: Served) -> None:
        statuses = [(await s.post("/v1/completions", {"prompt": "x"}))[0] for _ in range(50)]
        failed = [i for i, status in enumerate(statuses) if status == 500]
        assert failed == list(range(4, 50, 5))
        assert (s.sim.injected_failures, s.sim.completed) == (10, 40)

    drive(scenario, fail_ratio=0.2)


def test_a_client_that_goes_away_cancels_its_request_and_frees_the_slot() -> None:
    async def scenario(s: Served) -> None:
        body = {**CHAT, "max_tokens": 10_000, "stream": True}
        headers = {"X-Request-Id": "gone"}
        async with s.http.post("/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.content.readline()  # the first token is out
            assert s.sim.running == 1
        await until(lambda: s.sim.cancelled == 1, "cancelled")
        assert s.sim.cancelled_ids == ["chatcmpl-gone"] and s.sim.completed == 0
        await until(lambda: s.sim.running == 0, "released")
        await asyncio.wait_for(s.post("/v1/completions", {"prompt": "x"}), 60)

    drive(scenario, ttft_ms=0.0, itl_ms=1.0, max_model_len=20_000)
