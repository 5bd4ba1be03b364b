"""vLLM 0.32's wire contract as plain assertions, for every source that claims to speak it.

The assertions here are functions of what a source sent (frames, payloads, a /metrics page,
response bodies), and the ``check_live_*`` functions of tests/support/vllm_live.py drive a
running source (a ``LiveSource``) through them, so each runs on any source:

* payloads captured from real vLLM 0.32 (``tests/data/vllm-captures``, copied from the shared
  ``vllm-captures`` folder, which is read when the copy is missing):
  tests/e2e/test_vllm_contract.py;
* a live simulator reached through real sockets (HTTP and ZeroMQ): the same module;
* a real vLLM server (the real-vLLM tier): tests/realvllm/test_real_contract.py.

A live source needs ``--enable-prompt-tokens-details``, ``--enable-lora`` with an adapter
loadable at run time, and ``--kv-events-config`` with a replay endpoint. Prefill/decode
disaggregation's checks (:func:`check_live_pd`) take two more: a prefill and a decode server
(NixlConnector's kv_producer and kv_consumer; the simulator's roles), with prompt details on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

_LOCAL = Path(__file__).resolve().parents[1] / "data" / "vllm-captures"
_SHARED = Path(__file__).resolve().parents[3] / "shared" / "vllm-captures"
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
        if name not in theirs and (name in NIXL_FAMILIES or name in _NIXL_CREATED):
            _assert_nixl_family(name, family)  # a server with a KV connector's
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


# -- prefill/decode disaggregation (NixlConnector, pull mode) -------------------------------

# A prefill answer's kv_transfer_params in vLLM 0.32's order (shared/vllm-captures/
# pd-on-cpu.md; the observed object is tests/data/vllm-captures/pd-prefill-params.json).
PREFILL_PARAM_KEYS = [
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
    "remote_prefill_cached_tokens",
]  # fmt: skip
_UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
# What a prefill request carries (vLLM's toy proxy's, routing/pd's).
ASK_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def assert_prefill_params(params: Any, prompt_tokens: int, block_size: int) -> None:
    """A prefill answer's ``kv_transfer_params`` for a completion of `prompt_tokens` and one
    output token: where its blocks are held (this engine, its internal request id, a host and
    port), one list of block ids per KV cache group, one id per block, the last one partial."""
    assert isinstance(params, dict) and list(params) == PREFILL_PARAM_KEYS, params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    [ids] = params["remote_block_ids"]
    assert len(ids) == -(-prompt_tokens // block_size), (ids, prompt_tokens, block_size)
    assert all(isinstance(i, int) and i >= 1 for i in ids)  # 0 is vLLM's null block
    assert _UUID4.fullmatch(params["remote_engine_id"]), params["remote_engine_id"]
    assert re.fullmatch(r"cmpl-.+-0-[0-9a-f]{8}", params["remote_request_id"])
    assert isinstance(params["remote_host"], str) and params["remote_host"]
    assert isinstance(params["remote_port"], int) and 0 < params["remote_port"] < 65536
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["remote_num_tokens"] == prompt_tokens
    assert params["remote_blocks_expiry_time"] is None
    assert params["transfer_mode"] == "pull"
    cached = params["remote_prefill_cached_tokens"]
    assert isinstance(cached, int) and 0 <= cached <= prompt_tokens


def _le(bounds: list[float]) -> list[str]:
    """Bucket bounds as prometheus_client writes them (vLLM's pages), then +Inf."""
    return [floatToGoString(b) for b in bounds] + ["+Inf"]


# The NIXL connector's families (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py),
# which the captured pages lack (their servers had no connector): kind, help, bucket bounds.
NIXL_FAMILIES: dict[str, tuple[str, str, list[str]]] = {
    "vllm:nixl_xfer_time_seconds": (
        "histogram",
        "Histogram of transfer duration for NIXL KV Cache transfers.",
        _le([0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
    ),
    "vllm:nixl_post_time_seconds": (
        "histogram",
        "Histogram of transfer post time for NIXL KV Cache transfers.",
        _le([0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
    ),
    "vllm:nixl_bytes_transferred": (
        "histogram",
        "Histogram of bytes transferred per NIXL KV Cache transfers.",
        _le([2 ** (10 + i) for i in range(1, 25, 2)]),  # 2 KiB to 8 GiB
    ),
    "vllm:nixl_num_descriptors": (
        "histogram",
        "Histogram of number of descriptors per NIXL  KV Cache transfers.",
        _le([10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]),
    ),
    "vllm:nixl_num_failed_transfers_total": (
        "counter", "Number of failed NIXL KV Cache transfers.", []
    ),
    "vllm:nixl_num_failed_notifications_total": (
        "counter", "Number of failed NIXL KV Cache notifications.", []
    ),
    "vllm:nixl_num_kv_expired_reqs_total": (
        "counter",
        "Number of requests that had their KV expire. NOTE: This metric is tracked on the P "
        "instance.",
        [],
    ),
}  # fmt: skip
# Each one's _created gauge family, with its help.
_NIXL_CREATED = {
    name.removesuffix("_total") + "_created": help_text
    for name, (_, help_text, _) in NIXL_FAMILIES.items()
}


def _assert_nixl_family(name: str, family: Family) -> None:
    if name in _NIXL_CREATED:
        assert (family.kind, family.help) == ("gauge", _NIXL_CREATED[name]), name
        return
    kind, help_text, bounds = NIXL_FAMILIES[name]
    assert (family.kind, family.help) == (kind, help_text), name
    labels = {frozenset(labels) - {"le"} for _, labels, _ in family.samples}
    assert labels == {frozenset({"engine", "model_name"})}, (name, labels)
    assert _bounds(family) == bounds, (name, _bounds(family))


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
