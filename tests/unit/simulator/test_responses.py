"""simulator.responses: a completion's whole body and its pre-encoded SSE frames."""

from __future__ import annotations

import orjson

from simulator.engine import Job
from simulator.responses import SseFrames, final_body, job_usage
from simulator.tokens import output_text
from tests.support.sim_app import sse_data


def job(max_tokens: int, *, usage: bool = False, cached: int | None = None) -> Job:
    made = Job("cmpl-1", "sim-model", False, ["a", "b", "c"], max_tokens, True, usage, 1)
    made.cached_tokens = cached
    return made


def test_usage_counts_prompt_and_output_and_the_cached_tokens_when_reported() -> None:
    assert job_usage(job(4)) == {
        "prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4,
        "prompt_tokens_details": None,
    }  # fmt: skip
    assert job_usage(job(4, cached=2))["prompt_tokens_details"] == {"cached_tokens": 2}


def test_whole_bodies_for_chat_and_text() -> None:
    chat = final_body(job(3), chat=True)
    assert chat["object"] == "chat.completion" and chat["id"] == "cmpl-1"
    [choice] = chat["choices"]
    assert choice["message"] == {"role": "assistant", "content": output_text(3), "tool_calls": []}
    assert choice["finish_reason"] == "length"
    text = final_body(job(3), chat=False)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == output_text(3)
    assert list(chat) == ["id", "object", "created", "model", "choices", "usage"]


def stream(frames: SseFrames) -> list[object]:
    raw = frames.first() + b"".join(frames.token(i) for i in range(1, frames.job.max_tokens))
    return sse_data(raw)


def test_a_chat_stream_opens_with_the_role_and_ends_with_length_then_done() -> None:
    chunks = stream(SseFrames(job(3), chat=True))
    assert chunks[-1] == "[DONE]" and len(chunks) == 1 + 3 + 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert "".join(deltas) == output_text(3)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[1:-1]]
    assert reasons == [None, None, "length"]
    assert {c["object"] for c in chunks[:-1]} == {"chat.completion.chunk"}


def test_a_text_stream_with_usage_ends_with_a_usage_chunk_without_nulls() -> None:
    chunks = stream(SseFrames(job(2, usage=True), chat=False))
    assert "".join(c["choices"][0]["text"] for c in chunks[:2]) == output_text(2)
    usage_chunk = chunks[2]
    assert usage_chunk["choices"] == [] and chunks[3] == "[DONE]"
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    # Each frame is one JSON object on one `data:` line.
    assert all(orjson.dumps(c) for c in chunks[:3])
