"""vLLM 0.32's wire contract as plain assertions, for every source that claims to speak it.

The assertions are functions of what a source sent (frames, payloads, a /metrics page,
response bodies), and the ``check_live_*`` functions drive a running source (a
:class:`LiveSource`) through them, so each runs on any source:

* payloads captured from real vLLM 0.32 (``tests/data/vllm-captures``, copied from the shared
  ``vllm-captures`` folder, which is read when the copy is missing): tests/test_vllm_contract.py;
* a live simulator reached through real sockets (HTTP and ZeroMQ): the same module;
* a real vLLM server (the real-vLLM tier): tests/realvllm/test_real_contract.py.

A live source needs ``--enable-prompt-tokens-details``, ``--enable-lora`` with an adapter
loadable at run time, and ``--kv-events-config`` with a replay endpoint.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

_LOCAL = Path(__file__).resolve().parent / "data" / "vllm-captures"
_SHARED = Path(__file__).resolve().parents[2] / "shared" / "vllm-captures"
TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT = 60.0  # httpx's 5 s default is short for real vLLM on a busy 2-core machine


def capture(name: str) -> Path:
    """A captured file: the suite's copy, else the shared folder's."""
    for folder in (_LOCAL, _SHARED):
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(name)


# -- the contract: assertions on what any source sent --------------------------------------

# Each event's fields in vLLM 0.32's order; the ones in OPTIONAL are left out while None.
EVENT_FIELDS = {
    "BlockStored": [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ],
    "BlockRemoved": ["type", "block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": ["type"],
}  # fmt: skip
OPTIONAL = {"locality", "ownership", "session_id", "kv_cache_spec_sliding_window"}


def assert_kv_batch(payload: bytes) -> list[dict[str, Any]]:
    """A published payload: the array ``[ts, events, data_parallel_rank]`` of map events."""
    assert payload[0] == 0x93, f"not a msgpack array of 3: {payload[:1].hex()}"
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and ts > 1e9
    assert rank == 0 and isinstance(events, list)
    for event in events:
        assert isinstance(event, dict), event
        kind = event.get("type")
        assert kind in EVENT_FIELDS, kind
        assert [k for k in event if k not in OPTIONAL] == EVENT_FIELDS[kind], list(event)
        if kind == "AllBlocksCleared":
            continue
        hashes = event["block_hashes"]
        assert hashes and all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        assert event["medium"] == "GPU" and event["group_idx"] == 0
        if kind == "BlockRemoved":
            assert len(hashes) == 1, "one BlockRemoved per physical block"
        else:
            _assert_stored(event)
    return events


def _assert_stored(event: dict[str, Any]) -> None:
    n = len(event["block_hashes"])
    parent = event["parent_block_hash"]
    assert parent is None or (isinstance(parent, int) and 0 <= parent < 2**64)
    assert len(event["token_ids"]) == n * event["block_size"]
    lora = event["lora_name"]
    assert (event["lora_id"] is None) == (lora is None)
    assert event["extra_keys"] == [None if lora is None else [lora]] * n
    assert event["kv_cache_spec_kind"] == "full_attention"


def assert_kv_message(frames: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """One PUB message: topic, 8-byte big-endian sequence number, payload."""
    assert len(frames) == 3 and frames[0] == TOPIC and len(frames[1]) == 8, frames[:2]
    return int.from_bytes(frames[1], "big"), assert_kv_batch(frames[2])


def assert_replay_answer(messages: list[list[bytes]]) -> list[tuple[int, bytes]]:
    """A replay answer as a DEALER reads it: ``[b"", topic, seq, payload]`` per batch, in
    order, then the end marker ``[b"", b"", -1, b""]``."""
    assert messages and messages[-1] == [b"", b"", END_SEQ, b""]
    batches = []
    for frames in messages[:-1]:
        assert len(frames) == 4 and frames[0] == b"" and frames[1] == TOPIC, frames[:3]
        assert len(frames[2]) == 8
        assert_kv_batch(frames[3])
        batches.append((int.from_bytes(frames[2], "big"), frames[3]))
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
    return batches


# Families whose labels are not engine + model_name.
_OWN_LABELS = {
    "vllm:lora_requests_info": {"max_lora", "running_lora_adapters", "waiting_lora_adapters"},
    "vllm:admission_rejections_total": {"model_name", "reason"},
    "vllm:admission_rejections_created": {"model_name", "reason"},
    # Only with --tool-call-parser (Claude Code's tools need it): not in the captures.
    "vllm:tool_call_parser_invocations_total": {"model_name", "mode", "outcome", "request_type"},
    "vllm:tool_call_parser_invocations_created": {
        "model_name",
        "mode",
        "outcome",
        "request_type",
    },
}
# Families a server exports only with a flag the captured servers were started without.
_FLAG_FAMILIES = frozenset(
    {"vllm:tool_call_parser_invocations_total", "vllm:tool_call_parser_invocations_created"}
)
REQUIRED_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


@dataclass
class Family:
    kind: str
    help: str
    samples: list[tuple[str, dict[str, str], str]]  # (sample name, labels, value as written)


def parse_page(text: str) -> dict[str, Family]:
    """The ``vllm:`` families of a /metrics page, as written (names with their _total)."""
    list(text_string_to_metric_families(text))  # the official parser accepts the page
    families: dict[str, Family] = {}
    helps: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            current, kind = line[7:].split(" ")
            families[current] = Family(kind, helps.get(current, ""), [])
        elif line and not line.startswith("#") and current.startswith("vllm:"):
            m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
            assert m, line
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2] or ""))
            families[current].samples.append((m[1], labels, m[3]))
    return {k: v for k, v in families.items() if k.startswith("vllm:")}


def assert_metrics_page(text: str) -> dict[str, Family]:
    """A /metrics page: the families a router reads, vLLM's labels, a ``_created`` gauge
    family beside every counter and histogram, vLLM's info series."""
    families = parse_page(text)
    for name, kind in REQUIRED_FAMILIES.items():
        assert families.get(name, Family("missing", "", [])).kind == kind, name
    assert not [n for n in families if n.startswith("vllm:gpu_")], "deprecated gpu_* names"
    for name, family in families.items():
        if name in ("vllm:cache_config_info",):
            continue
        base = _OWN_LABELS.get(name, {"engine", "model_name"})
        for _, labels, _ in family.samples:
            assert base <= set(labels), (name, labels)
        if family.kind in ("counter", "histogram"):
            # prometheus_client drops a counter's _total, never a histogram's name's end.
            stem = name.removesuffix("_total") if family.kind == "counter" else name
            created = families.get(stem + "_created")
            assert created is not None and created.kind == "gauge", f"{name}: no _created"
            assert created.help == family.help
    reasons = {s[1]["finished_reason"] for s in families["vllm:request_success_total"].samples}
    assert {"stop", "length", "abort", "error", "repetition"} <= reasons
    _assert_cache_config(families["vllm:cache_config_info"])
    if "vllm:lora_requests_info" in families:
        for _, labels, value in families["vllm:lora_requests_info"].samples:
            assert set(labels) == _OWN_LABELS["vllm:lora_requests_info"]
            assert float(value) > 1e9  # a time: when this pair of adapter sets was last seen
    return families


def _assert_cache_config(family: Family) -> None:
    [(_, labels, value)] = family.samples
    assert value == "1.0" and set(labels) == CACHE_CONFIG_LABELS, set(labels) ^ CACHE_CONFIG_LABELS
    blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    assert int(labels["kv_cache_size_tokens"]) == blocks * size
    assert labels["engine"] == "0" and labels["enable_prefix_caching"] == "True"


CACHE_CONFIG_LABELS = {
    "_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens",
    "effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint",
    "enable_prefix_caching", "engine", "gpu_memory_utilization", "hash_block_size",
    "is_attention_free", "kv_cache_dtype_skip_layers", "kv_cache_layout",
    "kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens",
    "kv_offloading_backend", "kv_offloading_size", "kv_sharing_fast_prefill",
    "mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded",
    "mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
    "prefix_cache_retention_interval", "prefix_caching_hash_algo", "prefix_match_unit",
    "replayssm_buffer_len", "skip_page_size_padded", "sliding_window", "swa_bounded_replay",
    "use_kda_recoverssm", "use_replayssm", "user_specified_block_size",
}  # fmt: skip


# Histograms of token counts, whose buckets vLLM sizes by the server's max_model_len (1, 2, 5,
# 10, 20, 50, ... up to it), so they differ between servers of two context lengths.
TOKEN_SIZED = frozenset(
    f"vllm:{name}"
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_max_tokens",
                 "request_prefill_kv_computed_tokens")
)  # fmt: skip


def one_two_five(limit: int) -> list[str]:
    """vLLM's build_1_2_5_buckets(limit), as the page writes the bounds, then +Inf."""
    bounds, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return [*bounds, "+Inf"]
            bounds.append(f"{float(value)}")
        exponent += 1


def assert_metrics_like(text: str, reference: str, max_model_len: int | None = None) -> None:
    """Every family of `text` is one of the reference page's, with its type, help, label
    names and bucket bounds (those sized by the context length: the 1-2-5 series up to the
    source's `max_model_len`, when given)."""
    ours, theirs = parse_page(text), parse_page(reference)
    for name, family in ours.items():
        if name in _FLAG_FAMILIES and name not in theirs:
            continue
        assert name in theirs, f"{name} is not a vLLM family"
        ref = theirs[name]
        assert (family.kind, family.help) == (ref.kind, ref.help), name
        assert _label_names(family) == _label_names(ref), name
        if name in TOKEN_SIZED and max_model_len is not None:
            assert set(_bounds(family)) == set(one_two_five(max_model_len)), name
        else:
            assert _bounds(family) == _bounds(ref), name


def _label_names(family: Family) -> set[frozenset[str]]:
    return {frozenset(labels) for _, labels, _ in family.samples}


def _bounds(family: Family) -> list[str]:
    return [labels["le"] for name, labels, _ in family.samples if name.endswith("_bucket")]


def assert_models_page(body: Any, base: str, loras: dict[str, str]) -> None:
    """/v1/models: the base model's card, then one per adapter (`loras`: name -> path)."""
    assert body["object"] == "list"
    cards = {card["id"]: card for card in body["data"]}
    keys = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
    for card in cards.values():
        assert keys | {"permission"} == set(card), set(card)
        assert card["object"] == "model" and card["owned_by"] == "vllm"
        assert isinstance(card["created"], int)
        assert [p["object"] for p in card["permission"]] == ["model_permission"]
    assert cards[base]["parent"] is None and isinstance(cards[base]["max_model_len"], int)
    for name, path in loras.items():
        assert cards[name]["parent"] == base and cards[name]["root"] == path
        assert cards[name]["max_model_len"] is None


def assert_error(response: httpx.Response, status: int, err_type: str | None, param: str) -> str:
    """vLLM's OpenAI error body; returns its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if err_type is not None:
        assert error["type"] == err_type, error
    assert re.fullmatch(param, error["param"] or ""), error
    return str(error["message"])


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


# -- the captures ---------------------------------------------------------------------------


def captured_messages(name: str) -> list[list[bytes]]:
    """The PUB messages of a kv-events capture, each payload encoded again from the decoded
    batch (map order kept): its length must be the captured one, so the bytes are the same."""
    messages = []
    for line in capture(name).read_text().splitlines():
        record = json.loads(line)
        payload = msgspec.msgpack.encode(record["raw"])
        assert len(payload) == record["lens"][2], "the capture's batch encodes differently"
        messages.append([record["topic"].encode(), bytes.fromhex(record["seq_hex"]), payload])
    return messages


def captured_replay() -> list[list[bytes]]:
    frames = json.loads(capture("replay-frames.json").read_text())
    return [[bytes.fromhex(f["hex"]) for f in message] for message in frames]


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
