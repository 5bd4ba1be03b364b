"""vLLM 0.32's wire contract on a live source: a running vLLM-compatible server (a
:class:`LiveSource`) driven through the assertions of tests/support/vllm_contract.py, over
real sockets (HTTP and ZeroMQ), the simulator's in tests/e2e/test_vllm_contract.py and real
vLLM's in tests/realvllm/test_real_contract.py.

A live source needs ``--enable-prompt-tokens-details``, ``--enable-lora`` with an adapter
loadable at run time, and ``--kv-events-config`` with a replay endpoint. Prefill/decode
disaggregation's checks (:func:`check_live_pd`) take two more: a prefill and a decode server
(NixlConnector's kv_producer and kv_consumer; the simulator's roles), with prompt details on.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import zmq

from tests.support.vllm_contract import (
    ASK_REMOTE_DECODE,
    END_SEQ,
    TIMEOUT,
    TOPIC,
    assert_error,
    assert_kv_message,
    assert_metrics_like,
    assert_metrics_page,
    assert_models_page,
    assert_prefill_params,
    assert_replay_answer,
    capture,
    parse_page,
)

# -- sources --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveSource:
    """A running vLLM-compatible server: what the contract needs to reach it."""

    base_url: str
    model: str
    lora: str  # an adapter to load at run time, under a name the source does not serve yet
    kv_endpoint: str  # the PUB socket, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str  # the ROUTER socket
    lora_path: str = "/adapters/a"  # any path for the simulator; a real adapter for vLLM


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll until `predicate` is truthy (a generous ceiling, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


class Subscriber:
    """A SUB socket on a source's KV events, collecting every message it receives."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(endpoint)
        self.messages: list[list[bytes]] = []

    def drain(self) -> int:
        while self.sock.poll(10):
            self.messages.append(self.sock.recv_multipart())
        return len(self.messages)


def complete(source: LiveSource, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": source.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{source.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return dict(response.json())


def block_size_of(source: LiveSource) -> int:
    text = httpx.get(f"{source.base_url}/metrics", timeout=30).text
    [(_, labels, _)] = parse_page(text)["vllm:cache_config_info"].samples
    return int(labels["block_size"])


def subscribed(source: LiveSource, ctx: zmq.Context[zmq.Socket[bytes]]) -> Subscriber:
    """A subscriber that has received one message: ZeroMQ joins a SUB socket a moment after
    it connects, so small requests are sent until one of their batches arrives."""
    sub = Subscriber(ctx, source.kv_endpoint)
    rng = random.Random()
    bs = block_size_of(source)

    def joined() -> int:
        complete(source, [rng.randrange(1000, 30000) for _ in range(bs + 1)], 1)
        return sub.drain()

    wait_for(joined)
    return sub


# -- a live source: each check takes what reaches it ---------------------------------------


def check_live_kv_events_and_replay(
    live: LiveSource, zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Two identical requests: the prompt's full blocks, then the block decoding fills stored
    (chained to the prompt's last), and, from the second, that block stored again under the
    same hash while the first is still cached (no de-duplication). Replay resends it all."""
    sub = subscribed(live, zmq_ctx)
    bs = block_size_of(live)
    rng = random.Random()
    prompt = [rng.randrange(1000, 30000) for _ in range(3 * bs + bs // 2)]
    first = complete(live, prompt, bs)
    second = complete(live, prompt, bs)
    details = second["usage"]["prompt_tokens_details"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert details["cached_tokens"] == 3 * bs  # full blocks, the last prompt token computed

    def stores() -> list[dict[str, Any]]:
        sub.drain()
        events = [e for frames in sub.messages for e in assert_kv_message(frames)[1]]
        return [e for e in events if e["type"] == "BlockStored"]

    def found() -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        stored = stores()
        heads = [e for e in stored if e["token_ids"] == prompt[: 3 * bs]]
        if not heads:
            return None
        last = heads[0]["block_hashes"][-1]
        decoded = [e for e in stored if e["parent_block_hash"] == last]
        return (heads[0], decoded) if len(decoded) >= 2 else None

    head, decoded = wait_for(found)
    assert head["parent_block_hash"] is None and len(head["block_hashes"]) == 3
    assert [len(e["block_hashes"]) for e in decoded] == [1, 1]
    assert decoded[0]["token_ids"][: bs // 2] == prompt[3 * bs :]
    assert decoded[0]["block_hashes"] == decoded[1]["block_hashes"]
    assert decoded[0]["token_ids"] == decoded[1]["token_ids"]

    seqs = [assert_kv_message(frames)[0] for frames in sub.messages]
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.connect(live.replay_endpoint)
    dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
    answer: list[list[bytes]] = []
    while not answer or answer[-1][2:3] != [END_SEQ]:
        assert dealer.poll(30_000), "no replay answer"
        answer.append(dealer.recv_multipart())
    replayed = dict(assert_replay_answer(answer))
    for frames in sub.messages:
        assert replayed[int.from_bytes(frames[1], "big")] == frames[2]


def check_live_metrics(live: LiveSource) -> None:
    load = {"lora_name": live.lora, "lora_path": live.lora_path}
    httpx.post(
        f"{live.base_url}/v1/load_lora_adapter", json=load, timeout=TIMEOUT
    ).raise_for_status()
    complete(live, [11, 12, 13], 2)
    text = httpx.get(f"{live.base_url}/metrics", timeout=30).text
    unload(live)
    limit = httpx.get(f"{live.base_url}/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert_metrics_page(text)
    assert_metrics_like(text, capture("metrics-tiny.txt").read_text(), limit["max_model_len"])


def unload(live: LiveSource) -> None:
    """The adapter a check loaded goes again: a real server lives through the session."""
    gone = {"lora_name": live.lora}
    httpx.post(
        f"{live.base_url}/v1/unload_lora_adapter", json=gone, timeout=TIMEOUT
    ).raise_for_status()


def check_live_models_and_simple_gets(live: LiveSource) -> None:
    url = live.base_url
    assert_models_page(httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json(), live.model, {})
    load = {"lora_name": live.lora, "lora_path": live.lora_path}
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=TIMEOUT)
    # vLLM answers a load with a plain text body and, in 0.32, no content type at all.
    assert response.status_code == 200
    assert not response.headers.get("content-type", "").startswith("application/json")
    assert_models_page(
        httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json(),
        live.model,
        {live.lora: live.lora_path},
    )
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=TIMEOUT)
    unload(live)
    assert_error(again, 400, "InvalidUserInput", ".*")
    gone = {"lora_name": "never-loaded"}
    assert_error(
        httpx.post(f"{url}/v1/unload_lora_adapter", json=gone, timeout=TIMEOUT), 404, None, ".*"
    )
    load_body = httpx.get(f"{url}/load", timeout=TIMEOUT).json()
    assert set(load_body) == {"server_load"} and isinstance(load_body["server_load"], int)
    sources = httpx.get(f"{url}/kv_event_sources", timeout=TIMEOUT).json()
    assert list(sources) == ["0"]
    assert sources["0"] == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{live.kv_endpoint.rsplit(':', 1)[1]}",
        "replay_endpoint": f"tcp://*:{live.replay_endpoint.rsplit(':', 1)[1]}",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv-events",
    }


def check_live_errors(live: LiveSource) -> None:
    url = f"{live.base_url}/v1/completions"
    limit = httpx.get(f"{live.base_url}/v1/models", timeout=TIMEOUT).json()["data"][0][
        "max_model_len"
    ]

    def post(**body: Any) -> httpx.Response:
        body = {"model": live.model, "prompt": [1, 2, 3], **body}
        return httpx.post(url, json=body, timeout=TIMEOUT)

    message = assert_error(post(model="nope"), 404, "NotFoundError", "model")
    assert re.fullmatch(r"The model `nope` does not exist\. Valid aliases: .+\.", message)
    message = assert_error(post(prompt=[7] * (limit + 1)), 400, "BadRequestError", "input_tokens")
    assert message.startswith(
        f"This model's maximum context length is {limit} tokens. However, your prompt "
        f"contains at least {limit + 1} input tokens"
    )
    assert message.endswith(f"(parameter=input_tokens, value={limit + 1})")
    message = assert_error(post(max_tokens=limit + 1), 400, "BadRequestError", "max_tokens")
    assert message == (
        f"max_tokens={limit + 1} cannot be greater than max_model_len={limit}. "
        f"Please request fewer output tokens. (parameter=max_tokens, value={limit + 1})"
    )
    # Within the limit, max_tokens is clamped to the room the prompt leaves, not refused.
    clamped = post(prompt=[7] * (limit - 2), max_tokens=limit, ignore_eos=True)
    assert clamped.status_code == 200, clamped.text
    assert clamped.json()["usage"]["completion_tokens"] == 2
    message = assert_error(
        post(stream_options={"include_usage": True}), 400, None, "stream_options"
    )
    assert message == (
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)"
    )
    broken = httpx.post(
        url, content=b'{"model": ', headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert_error(broken, 400, "Bad Request", r"body\.\d+")


def _by_source(text: str) -> dict[str, float]:
    family = parse_page(text)["vllm:prompt_tokens_by_source_total"]
    return {labels["source"]: float(value) for _, labels, value in family.samples}


def _sample(text: str, name: str) -> float:
    [(_, _, value)] = [s for f in parse_page(text).values() for s in f.samples if s[0] == name]
    return float(value)


def check_live_pd(prefill: LiveSource, decode: LiveSource) -> None:
    """A request's two legs by hand, as a disaggregating router sends them: the prefill's
    answer carries its transfer parameters; the decode, given them with the original request,
    takes every prompt token by transfer (none computed), reports the prefill's cache hits as
    cached (never the transferred tokens), and counts one NIXL transfer."""
    before = httpx.get(f"{decode.base_url}/metrics", timeout=TIMEOUT).text
    bs = block_size_of(prefill)
    rng = random.Random()
    prompt = [rng.randrange(1000, 30000) for _ in range(3 * bs + bs // 2)]
    request = {"model": prefill.model, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    first = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": ASK_REMOTE_DECODE}
    response = httpx.post(f"{prefill.base_url}/v1/completions", json=first, timeout=TIMEOUT)
    response.raise_for_status()
    answer = response.json()
    assert list(answer)[-1] == "kv_transfer_params", list(answer)
    params = answer["kv_transfer_params"]
    assert_prefill_params(params, len(prompt), bs)

    second = {"kv_transfer_params": params, **request, "max_tokens": 4}
    response = httpx.post(f"{decode.base_url}/v1/completions", json=second, timeout=120)
    response.raise_for_status()
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 4)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == params["remote_prefill_cached_tokens"]

    after = httpx.get(f"{decode.base_url}/metrics", timeout=TIMEOUT).text
    old, new = _by_source(before), _by_source(after)
    assert new["external_kv_transfer"] - old["external_kv_transfer"] == len(prompt)
    assert new["local_compute"] == old["local_compute"]
    count = "vllm:nixl_xfer_time_seconds_count"
    assert _sample(after, count) - _sample(before, count) == 1
    failed = "vllm:nixl_num_failed_transfers_total"
    assert _sample(after, failed) == _sample(before, failed)
    reference = capture("metrics-tiny.txt").read_text()
    for source in (prefill, decode):
        text = httpx.get(f"{source.base_url}/metrics", timeout=TIMEOUT).text
        card = httpx.get(f"{source.base_url}/v1/models", timeout=TIMEOUT).json()["data"][0]
        assert_metrics_page(text)
        assert {"vllm:nixl_xfer_time_seconds", failed} <= set(parse_page(text))
        assert_metrics_like(text, reference, card["max_model_len"])
