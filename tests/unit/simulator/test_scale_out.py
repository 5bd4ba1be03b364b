"""simulator.scale_out: vLLM 0.32's --enable-scale-out routes: render (template and tokenize,
no run), the batch of conversations, and token-in token-out generate."""

from __future__ import annotations

from simulator.tokens import output_text, output_token_ids, token_ids
from tests.support.sim_app import Served, drive, sse_data

USER = [{"role": "user", "content": "hello there"}]


def test_render_chat_gives_the_tokens_and_the_sampling_params_it_would_run_with() -> None:
    async def scenario(s: Served) -> None:
        status, rendered = await s.post(
            "/v1/chat/completions/render",
            {"messages": USER, "temperature": 0, "stop": "x"},
            headers={"X-Request-Id": "r1"},
        )  # fmt: skip
        assert status == 200 and rendered["request_id"] == "chatcmpl-r1"
        assert rendered["token_ids"] == token_ids(["user", "hello", "there"])
        params = rendered["sampling_params"]
        assert params["max_tokens"] == 100 - 3  # the room the prompt leaves
        assert params["temperature"] == 0.0 and "top_p" not in params  # greedy
        assert params["stop"] == ["x"]
        assert s.sim.received == 0 and s.sim.running == 0  # nothing ran

    drive(scenario, max_model_len=100)


def test_render_completions_one_request_per_prompt_and_messages_as_chat() -> None:
    async def scenario(s: Served) -> None:
        _, many = await s.post(
            "/v1/completions/render",
            {"prompt": ["a b", "c"], "max_tokens": 5},
            headers={"X-Request-Id": "q"},
        )
        assert [r["request_id"] for r in many] == ["cmpl-q-0", "cmpl-q-1"]
        assert [len(r["token_ids"]) for r in many] == [2, 1]
        assert many[0]["sampling_params"]["max_tokens"] == 5
        _, [one] = await s.post("/v1/completions/render", {"prompt": [5, 6, 7]})
        assert one["token_ids"] == [5, 6, 7] and "max_tokens" not in one["sampling_params"]
        body = {"model": "sim-model", "max_tokens": 4, "messages": USER, "system": "hi"}
        _, rendered = await s.post("/v1/messages/render", body)
        assert rendered["token_ids"] == token_ids(["system", "hi", "user", "hello", "there"])
        assert (await s.post("/v1/messages/render", {"messages": USER}))[0] == 400

    drive(scenario)


def test_a_batch_answers_one_choice_per_conversation_with_usage_summed() -> None:
    async def scenario(s: Served) -> None:
        body = {"messages": [USER, [{"role": "user", "content": "x"}]], "max_tokens": 3}
        status, answer = await s.post("/v1/chat/completions/batch", body)
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1]
        assert answer["choices"][1]["message"]["content"] == output_text(3)
        assert answer["usage"]["prompt_tokens"] == 3 + 2
        assert answer["usage"]["completion_tokens"] == 6 and s.sim.completed == 2
        assert (await s.post("/v1/chat/completions/batch", {"messages": []}))[0] == 400

    drive(scenario)


def test_generate_takes_token_ids_and_answers_token_ids_whole_or_streamed() -> None:
    async def scenario(s: Served) -> None:
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
        status, whole = await s.post("/inference/v1/generate", body)
        assert status == 200 and whole["choices"][0]["token_ids"] == output_token_ids(4)
        assert whole["usage"]["prompt_tokens"] == 3
        chunks = sse_data(
            await s.stream(
                "/inference/v1/generate",
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            )
        )
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 4
        ids = [c["choices"][0]["token_ids"][0] for c in chunks[:-2]]
        assert ids == output_token_ids(4)
        assert chunks[-3]["choices"][0]["finish_reason"] == "length"
        _, room = await s.post(
            "/inference/v1/generate", {"token_ids": [1] * 60, "sampling_params": {}}
        )
        assert room["usage"]["completion_tokens"] == 4  # max_model_len 64 less the prompt

    drive(scenario, max_model_len=64)


def test_generate_refuses_what_vllms_model_refuses() -> None:
    async def scenario(s: Served) -> None:
        for body, param in (
            ({"sampling_params": {}}, "body.token_ids"),
            ({"token_ids": [1, -2], "sampling_params": {}}, "body.token_ids"),
            ({"token_ids": [], "sampling_params": {}}, "body.token_ids"),
            ({"token_ids": [1], "sampling_params": 3}, "body.sampling_params"),
        ):
            status, error = await s.post("/inference/v1/generate", body)
            assert (status, error["error"]["param"]) == (400, param), body
        status, _ = await s.post(
            "/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "model": "x"}
        )
        assert status == 404

    drive(scenario)
