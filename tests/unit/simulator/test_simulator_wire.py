"""The simulator's vLLM 0.32 wire pieces, unit by unit: its KV event encoding against the bytes
captured from vLLM, its prefix cache's events (decode blocks, no de-duplication, evictions per
physical block, hashes from tokens only), and the /metrics details a router reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import msgspec

from simulator.config import SimConfig
from simulator.engine import Simulator
from simulator.kv_publisher import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from simulator.metrics import go_float, render_metrics
from simulator.prefix_cache import PrefixCache, block_hash
from tests.support.common import ROOT
from tests.support.vllm_contract import (
    assert_kv_batch,
    assert_metrics_like,
    assert_metrics_page,
    capture,
    captured_replay,
)


def rebuilt(payload: bytes) -> KVEventBatch:
    """A captured batch decoded into the simulator's own structs."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    structs: list[Any] = []
    for event in events:
        fields = {k: v for k, v in event.items() if k != "type"}
        if "extra_keys" in fields:
            fields["extra_keys"] = [None if k is None else tuple(k) for k in fields["extra_keys"]]
        structs.append(
            {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}[event["type"]](**fields)
        )
    return KVEventBatch(ts=ts, events=structs, data_parallel_rank=rank)


def test_the_simulator_encodes_a_captured_batch_byte_for_byte() -> None:
    for frames in captured_replay()[:-1]:
        payload = frames[3]
        assert encode_batch(rebuilt(payload)) == payload


def test_removals_and_lora_stores_encode_to_the_captured_lengths() -> None:
    """The jsonl captures keep the decoded batch and its length: LoRA stores and removals,
    which the replay capture lacks, rebuilt in the simulator's structs, are as long."""
    for line in capture("kv-events-tiny-excerpt.jsonl").read_text().splitlines():
        record = json.loads(line)
        payload = msgspec.msgpack.encode(record["raw"])
        assert len(encode_batch(rebuilt(payload))) == record["lens"][2]


def decoded(events: list[Any]) -> list[dict[str, Any]]:
    return assert_kv_batch(
        encode_batch(KVEventBatch(ts=1.8e9, events=events, data_parallel_rank=0))
    )


def test_prefix_cache_stores_blocks_again_and_evicts_each_physical_block() -> None:
    cache = PrefixCache(capacity=6, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    hits, hashes, events = cache.prefill(None, prompt)
    assert hits == 0 and len(hashes) == 2
    [stored] = decoded(events)
    assert stored["block_hashes"] == hashes and stored["parent_block_hash"] is None
    # The same prompt again: both blocks reused ((10 - 1) // 4 = 2), nothing stored.
    assert cache.prefill(None, prompt)[0] == 2
    # A prompt of exactly 2 blocks: its last block is computed again, stored again.
    hits, _, events = cache.prefill(None, prompt[:8])
    [again] = decoded(events)
    assert hits == 1 and again["block_hashes"] == hashes[1:]
    assert again["parent_block_hash"] == hashes[0]
    assert (len(cache), cache.physical_blocks) == (2, 3)
    # Room for 4 more blocks of another prompt: 1 removed, one event per physical block, the
    # least recently used: block 1's first copy (block 0 was reused since), its twin kept.
    _, _, events = cache.prefill(None, list(range(200, 216)))
    removed, stored = decoded(events)
    assert (removed["type"], removed["block_hashes"]) == ("BlockRemoved", [hashes[1]])
    assert stored["type"] == "BlockStored" and len(stored["block_hashes"]) == 4
    assert hashes[1] in cache and (len(cache), cache.physical_blocks) == (6, 6)


def test_hashes_come_from_tokens_and_lora_only_the_same_in_every_process() -> None:
    tokens = [5, 6, 7, 8]
    assert block_hash(None, tokens, None) != block_hash(None, tokens, "lora-a")
    code = (
        "from simulator.prefix_cache import block_hash; print(block_hash(None, [5, 6, 7, 8], None))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    assert seen == {str(block_hash(None, tokens, None))}


def test_lora_stores_carry_the_adapter() -> None:
    cache = PrefixCache(capacity=8, block_size=4)
    _, _, events = cache.prefill("lora-a", list(range(9)))
    [stored] = decoded(events)
    assert (stored["lora_id"], stored["lora_name"]) == (1, "lora-a")
    assert stored["extra_keys"] == [["lora-a"], ["lora-a"]]


def test_go_floats_as_prometheus_client_writes_them() -> None:
    assert go_float(1796400045.9194825) == "1.7964000459194825e+09"
    assert [go_float(v) for v in (0, 39867, 0.5, float("inf"))] == ["0.0", "39867.0", "0.5", "+Inf"]


def test_metrics_page_keeps_a_lora_series_per_adapter_pair_seen() -> None:
    sim = Simulator(SimConfig(loras=("lora-a",), max_loras=2, block_size=32, cache_blocks=10))
    sim.lora_waiting["lora-a"] += 1
    sim.note_lora_state()
    sim.lora_waiting["lora-a"] -= 1
    sim.lora_running["lora-a"] += 1
    sim.note_lora_state()
    sim.lora_running["lora-a"] -= 1
    text = render_metrics(sim)
    families = assert_metrics_page(text)
    assert_metrics_like(text, capture("metrics-tiny.txt").read_text())
    pairs = {
        (labels["max_lora"], labels["running_lora_adapters"], labels["waiting_lora_adapters"])
        for _, labels, _ in families["vllm:lora_requests_info"].samples
    }
    assert pairs == {("2", "", "lora-a"), ("2", "lora-a", ""), ("2", "", "")}
    [(_, info, _)] = families["vllm:cache_config_info"].samples
    assert (info["block_size"], info["num_gpu_blocks"], info["kv_cache_size_tokens"]) == (
        "32",
        "10",
        "320",
    )
