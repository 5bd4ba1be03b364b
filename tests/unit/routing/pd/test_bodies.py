"""Prefill/decode disaggregation's bodies (routing.pd.bodies): vLLM's prefill overrides, the
decode body's splice (the client's bytes otherwise untouched), the transfer parameters
read from a prefill answer, and the uncached-prompt estimate the bypass compares."""

from __future__ import annotations

import orjson

from routing.pd.bodies import (
    ASK_REMOTE_DECODE,
    decode_body,
    prefill_body,
    transfer_params,
    uncached_tokens,
)
from routing.policies.base import Choice, Prediction, RequestInfo

# As vLLM 0.32's NixlConnector answered a 133-token prompt (../shared/vllm-captures).
PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3, 4, 5]],
    "remote_engine_id": "aaf1a07b", "remote_request_id": "cmpl-87150626a304931f-0-b186427c",
    "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "transfer_mode": "pull",
}  # fmt: skip


def test_the_prefill_body_asks_for_one_whole_token_and_a_remote_decode() -> None:
    payload = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 200, "min_tokens": 5,
        "max_completion_tokens": 300, "temperature": 0.7, "logprobs": True,
    }  # fmt: skip
    body = orjson.loads(prefill_body(payload, "m"))
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["kv_transfer_params"] == ASK_REMOTE_DECODE
    # Everything else as the client sent it.
    assert body["temperature"] == 0.7 and body["logprobs"] is True
    assert body["messages"] == payload["messages"]
    # An alias's (or a fallback's) request names the model it resolved to.
    assert orjson.loads(prefill_body({**payload, "model": "chat"}, "m"))["model"] == "m"


def test_the_decode_body_is_the_clients_bytes_with_the_parameters_spliced_in() -> None:
    client = b'{"model": "m",  "prompt": "x",\n "max_tokens": 24, "temperature": 0.50}'
    body = decode_body(client, PARAMS)
    assert body.endswith(client[1:])  # the client's own bytes, spacing and all
    parsed = orjson.loads(body)
    assert parsed["kv_transfer_params"] == PARAMS
    assert parsed["max_tokens"] == 24 and parsed["temperature"] == 0.5
    assert orjson.loads(decode_body(b"  {}", PARAMS)) == {"kv_transfer_params": PARAMS}


def test_transfer_parameters_are_read_from_the_prefill_answer_or_found_missing() -> None:
    answer = orjson.dumps(
        {"id": "cmpl-1", "choices": [{"text": "a"}], "kv_transfer_params": PARAMS}
    )
    assert transfer_params(answer) == PARAMS
    assert transfer_params(b'{"id": "cmpl-1", "choices": []}') is None
    assert transfer_params(b'{"kv_transfer_params": null}') is None
    assert transfer_params(b"not json") is None


def test_the_uncached_estimate_counts_tokens_or_text_less_the_prediction() -> None:
    ids = RequestInfo("m", {}, (), tokens=list(range(1000)))
    assert uncached_tokens(ids) == 1000
    held = Choice(None, "kv", Prediction(ids, 1, 960, 0.96, 32))
    assert uncached_tokens(ids, held) == 40
    text = RequestInfo("m", {"messages": [{"role": "user", "content": "abcd" * 300}]}, ())
    assert uncached_tokens(text) == 300
    shared = Choice(None, "prefix", Prediction(text, 1, None, 0.5))
    assert uncached_tokens(text, shared) == 150
