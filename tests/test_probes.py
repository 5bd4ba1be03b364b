# ruff: noqa: E501 - the recorded /metrics samples below keep vLLM's own long lines
"""Celery health probes against simulated and fake vLLM servers.

The task function runs in this process (as Celery's eager mode would) on the shared test
database; the parsing is also checked on recorded vLLM /metrics texts, one with today's
metric names and one with the older `gpu_*` names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from unittest.mock import ANY

import httpx
import pytest
from aiohttp import web
from django.utils import timezone
from pytest_django.fixtures import Settings as SettingsWrapper

from controlpanel.fleet import health, probes, services
from controlpanel.fleet.tasks import probe_workers
from controlpanel.registry.models import (
    Event,
    RoutingGeneration,
    ServedModel,
    Worker,
    WorkerSample,
    WorkerSource,
)
from controlpanel.routers import snapshot as selectors
from tests.conftest import (
    AddWorker,
    RouterServer,
    SimulatorLoop,
    StartSimulator,
    free_port,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

# vLLM 0.11 with --data-parallel-size 2 (two engines), as /metrics returned it, trimmed of
# most process_* and python_* families.
RECORDED_NEW = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18342.0
python_gc_objects_collected_total{generation="1"} 4121.0
python_gc_objects_collected_total{generation="2"} 977.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.145189888e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",sleep_state="discard_all"} 0.0
vllm:engine_sleep_state{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct",sleep_state="discard_all"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0e+06
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
vllm:prefix_cache_queries_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 600000.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400000.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
vllm:prefix_cache_hits_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.123456e+06
vllm:prompt_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 901234.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
vllm:prompt_tokens_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 345678.0
vllm:generation_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 298765.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
vllm:generation_tokens_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121853e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1021.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 77.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 880.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 61.0
vllm:request_success_total{engine="1",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121871e+09
vllm:request_success_created{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121871e+09
vllm:request_success_created{engine="0",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121871e+09
vllm:request_success_created{engine="1",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121871e+09
vllm:request_success_created{engine="1",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121871e+09
vllm:request_success_created{engine="1",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121871e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="meta-llama/Llama-3.1-8B-Instruct"} 200.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="meta-llama/Llama-3.1-8B-Instruct"} 350.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 420.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 510.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="7.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="10.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="20.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="40.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="80.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="160.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="640.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 38.4
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 30.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.06",model_name="meta-llama/Llama-3.1-8B-Instruct"} 150.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.08",model_name="meta-llama/Llama-3.1-8B-Instruct"} 300.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 380.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.25",model_name="meta-llama/Llama-3.1-8B-Instruct"} 450.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 455.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.75",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="5.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="7.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="10.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="20.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="40.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="80.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="160.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="640.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2560.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 456.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31.7
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121888e+09
vllm:time_to_first_token_seconds_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7645903121888e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27910",prefix_caching_hash_algo="sha256"} 1.0
"""

# vLLM 0.8 (V1 engine, before the metric renames): gpu_cache_usage_perc and gpu_prefix_*.
RECORDED_OLD = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="Qwen/Qwen2.5-7B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="Qwen/Qwen2.5-7B-Instruct"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.62
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried blocks.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 20480.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached blocks.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 5120.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="Qwen/Qwen2.5-7B-Instruct"} 311.0
vllm:request_success_total{finished_reason="length",model_name="Qwen/Qwen2.5-7B-Instruct"} 9.0
vllm:request_success_total{finished_reason="abort",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
"""

NEW_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OLD_MODEL = "Qwen/Qwen2.5-7B-Instruct"
LATER_BOUNDS = ("0.25", "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0")
LATER_BOUNDS += ("80.0", "160.0", "640.0", "2560.0", "+Inf")


def key(name: str, **labels: str) -> str:
    """A sample line's name and labels as the recorded texts spell them (labels sorted)."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def advance(text: str, increments: dict[str, float]) -> str:
    """The same server a few seconds later: the given samples grew by the given amounts."""

    def grow(match: re.Match[str]) -> str:
        value = float(match.group(2)) + increments.get(match.group(1), 0.0)
        return f"{match.group(1)} {value!r}"

    return re.sub(r"^(\S+) (\S+)$", grow, text, flags=re.MULTILINE)


def new_scrape_five_seconds_later() -> str:
    """Engine 0 answered 10 requests: 4000 prompt tokens looked up, 3000 of them cached,
    first tokens after 0.02-0.04 s (2), 0.04-0.06 s (4), 0.06-0.08 s (2), 0.08-0.1 s (2)."""
    engine0 = {"engine": "0", "model_name": NEW_MODEL}
    increments = {
        key("vllm:prefix_cache_queries_total", **engine0): 4000,
        key("vllm:prefix_cache_hits_total", **engine0): 3000,
        key("vllm:request_success_total", finished_reason="stop", **engine0): 8,
        key("vllm:request_success_total", finished_reason="length", **engine0): 2,
    }
    ttft = "vllm:time_to_first_token_seconds"
    growth = {"0.04": 2, "0.06": 6, "0.08": 8, "0.1": 10} | dict.fromkeys(LATER_BOUNDS, 10)
    for le, added in growth.items():
        increments[key(f"{ttft}_bucket", le=le, **engine0)] = added
    increments[key(f"{ttft}_count", **engine0)] = 10
    return advance(RECORDED_NEW, increments)


# --- parsing, on recorded texts ------------------------------------------------------------


def parsed(text: str) -> probes.Scrape:
    scrape = probes.parse_scrape(text)
    assert scrape is not None
    return scrape


def test_parse_recorded_sample_with_current_names() -> None:
    scrape = parsed(RECORDED_NEW)
    assert scrape.running == 4  # summed over both engines
    assert scrape.waiting == 2
    assert scrape.kv_cache_usage == pytest.approx(0.1875)  # the engines' mean
    assert scrape.prefix_queries == 1_800_000 and scrape.prefix_hits == 1_000_000
    assert scrape.requests == 2041  # every finished_reason, both engines
    assert scrape.sleeping is False  # awake=1: not "value > 0 means sleeping"
    assert scrape.ttft_buckets is not None
    assert scrape.ttft_buckets["0.1"] == 800 and scrape.ttft_buckets["+Inf"] == 968


def test_parse_recorded_sample_with_old_names() -> None:
    scrape = parsed(RECORDED_OLD)
    assert (scrape.running, scrape.waiting) == (2, 5)
    assert scrape.kv_cache_usage == pytest.approx(0.62)
    assert (scrape.prefix_queries, scrape.prefix_hits) == (20480, 5120)
    assert scrape.requests == 320
    assert scrape.ttft_buckets is None and scrape.sleeping is None

    later = advance(
        RECORDED_OLD,
        {
            key("vllm:gpu_prefix_cache_queries_total", model_name=OLD_MODEL): 100,
            key("vllm:gpu_prefix_cache_hits_total", model_name=OLD_MODEL): 25,
        },
    )
    first = probes.read_metrics(RECORDED_OLD, previous={}, at=100.0)
    second = probes.read_metrics(later, previous=first.counters, at=105.0)
    assert second.metrics["prefix_hit_rate"] == pytest.approx(0.25)
    assert second.metrics["kv_cache_usage"] == pytest.approx(0.62)
    assert second.metrics["ttft_p50"] is None  # not exported: unknown, not zero


def test_the_current_name_wins_when_a_server_exports_both() -> None:
    text = "vllm:kv_cache_usage_perc 0.3\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parsed(text).kv_cache_usage == pytest.approx(0.3)


def test_first_probe_has_load_but_no_rates() -> None:
    reading = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    assert reading.metrics == {
        "running": 4,
        "waiting": 2,
        "kv_cache_usage": pytest.approx(0.1875),
        "prefix_hit_rate": None,
        "ttft_p50": None,
        "ttft_p95": None,
        "rps": None,
        "vllm_series": ANY,  # vLLM's own series, kept for the router (test_vllm_metrics.py)
    }
    assert reading.counters["at"] == 1000.0
    assert reading.counters["prefix_queries"] == 1_800_000


def test_rates_come_from_deltas_between_two_probes() -> None:
    first = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    # As stored in Worker.scrape_state: through JSON.
    stored = httpx.Response(200, json=first.counters).json()
    second = probes.read_metrics(new_scrape_five_seconds_later(), previous=stored, at=1005.0)
    metrics = second.metrics
    assert metrics["prefix_hit_rate"] == pytest.approx(0.75)  # not the lifetime 0.56
    assert metrics["rps"] == pytest.approx(2.0)
    # p50: rank 5 of 10 lies in (0.04, 0.06] holding ranks 3-6 -> 0.04 + 0.02 * 3/4.
    assert metrics["ttft_p50"] == pytest.approx(0.055)
    # p95: rank 9.5 lies in (0.08, 0.1] holding ranks 9-10 -> 0.08 + 0.02 * 1.5/2.
    assert metrics["ttft_p95"] == pytest.approx(0.095)


def test_no_traffic_between_probes_gives_unknown_rates_not_zero() -> None:
    first = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    second = probes.read_metrics(RECORDED_NEW, previous=first.counters, at=1005.0)
    assert second.metrics["prefix_hit_rate"] is None
    assert second.metrics["ttft_p50"] is None and second.metrics["ttft_p95"] is None
    assert second.metrics["rps"] == 0.0  # measured: no request finished in 5 s


def test_counter_reset_counts_everything_since_the_restart() -> None:
    before = probes.read_metrics(new_scrape_five_seconds_later(), previous={}, at=1000.0)
    after = probes.read_metrics(RECORDED_NEW, previous=before.counters, at=1010.0)
    assert after.metrics["prefix_hit_rate"] == pytest.approx(1_000_000 / 1_800_000)
    assert after.metrics["rps"] == pytest.approx(2041 / 10)
    assert after.metrics["ttft_p50"] is not None


@pytest.mark.parametrize("text", ["", "# nothing here\n", "<html><body>502</body></html>"])
def test_missing_or_unreadable_metrics_are_none(text: str) -> None:
    reading = probes.read_metrics(text, previous={}, at=1.0)
    assert reading.metrics == dict.fromkeys(probes.METRIC_KEYS)
    assert reading.sleeping is None


def test_a_failed_scrape_keeps_the_previous_counters() -> None:
    first = probes.read_metrics(RECORDED_NEW, previous={}, at=1000.0)
    failed = probes.read_metrics(None, previous=first.counters, at=1005.0)
    assert failed.metrics == dict.fromkeys(probes.METRIC_KEYS)
    assert failed.counters == first.counters
    garbled = probes.read_metrics("<html>502</html>", previous=first.counters, at=1005.0)
    assert garbled.counters == first.counters
    # The next good scrape measures over both intervals.
    third = probes.read_metrics(
        new_scrape_five_seconds_later(), previous=failed.counters, at=1010.0
    )
    assert third.metrics["rps"] == pytest.approx(1.0)


def sleep_lines(awake: float, offloaded: float, discarded: float) -> str:
    labels = 'engine="0",model_name="m"'
    return (
        f'vllm:engine_sleep_state{{{labels},sleep_state="awake"}} {awake}\n'
        f'vllm:engine_sleep_state{{{labels},sleep_state="weights_offloaded"}} {offloaded}\n'
        f'vllm:engine_sleep_state{{{labels},sleep_state="discard_all"}} {discarded}\n'
    )


@pytest.mark.parametrize(
    ("text", "sleeping"),
    [
        (sleep_lines(1, 0, 0), False),
        (sleep_lines(0, 1, 0), True),  # sleep level 1
        (sleep_lines(0, 0, 1), True),  # sleep level 2
        ("vllm:engine_sleep_state 1\n", True),  # unlabelled: above zero means asleep
        ("vllm:engine_sleep_state 0\n", False),
        ("vllm:num_requests_running 0\n", None),
    ],
)
def test_engine_sleep_state(text: str, sleeping: bool | None) -> None:
    assert parsed(text).sleeping is sleeping


def test_histogram_quantile_edges() -> None:
    assert probes.histogram_quantile(0.5, []) is None
    assert probes.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    # Everything above the last finite bound: Prometheus answers that bound.
    assert probes.histogram_quantile(0.5, [(0.1, 0.0), (1.0, 0.0), (float("inf"), 4.0)]) == 1.0
    assert probes.histogram_quantile(0.5, [(0.1, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.05)


# --- servers for the end-to-end tests ------------------------------------------------------


class FakeVllm:
    """A server whose /health status, /metrics text and model list a test sets at will,
    for what the simulator does not do (no metrics, old names, a sleeping engine)."""

    def __init__(self, model: str = "fake-model") -> None:
        self.health_status = 200
        self.metrics_status = 200
        self.metrics_text = ""
        self.models_payload: dict[str, Any] = {
            "object": "list",
            "data": [{"id": model, "object": "model", "root": model, "parent": None}],
        }
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(status=self.metrics_status, text=self.metrics_text)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(self.models_payload)


class HangingServer:
    """Accepts connections, reads the requests and never answers (vLLM stuck in a
    CUDA call looks like this), until the client gives up."""

    def __init__(self) -> None:
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> HangingServer:
        self._server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
def fake_vllm(sim_loop: SimulatorLoop) -> Iterator[Callable[..., FakeVllm]]:
    started: list[FakeVllm] = []

    def start(model: str = "fake-model") -> FakeVllm:
        fake: FakeVllm = sim_loop.run(FakeVllm(model).start())
        started.append(fake)
        return fake

    yield start
    for fake in started:
        sim_loop.run(fake.stop())


@pytest.fixture
def hanging_server(sim_loop: SimulatorLoop) -> Iterator[Callable[[], HangingServer]]:
    started: list[HangingServer] = []

    def start() -> HangingServer:
        server: HangingServer = sim_loop.run(HangingServer().start())
        started.append(server)
        return server

    yield start
    for server in started:
        sim_loop.run(server.stop())


@pytest.fixture(autouse=True)
def probe_settings(settings: SettingsWrapper) -> SettingsWrapper:
    settings.CONTROLPANEL_PROBE_TIMEOUT = 1.0
    settings.CONTROLPANEL_UNHEALTHY_AFTER = 3
    settings.CONTROLPANEL_HEALTHY_AFTER = 2
    settings.CONTROLPANEL_MODELS_EVERY = 6
    settings.CONTROLPANEL_HISTORY_MINUTES = 30
    return settings


def bare_worker(url: str, model: str = "m") -> Worker:
    """A row for a server that cannot be discovered (dead or hanging)."""
    return Worker.objects.create(
        url=url, name=url, source=WorkerSource.OPERATOR, models=[{"id": model}]
    )


def fresh(worker: Worker) -> Worker:
    return Worker.objects.get(pk=worker.pk)


def events(kind: str, worker: Worker) -> list[Event]:
    return list(Event.objects.filter(kind=kind, worker=worker).order_by("id"))


def complete(url: str, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    httpx.post(f"{url}/v1/completions", json=body, timeout=10).raise_for_status()


# --- healthy workers -----------------------------------------------------------------------


def test_healthy_worker_metrics_samples_and_deltas(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")

    assert probe_workers() == 1
    first = fresh(worker)
    assert first.state == "active" and first.consecutive_successes == 1
    assert first.metrics == {
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": 0.0,
        "prefix_hit_rate": None,  # a rate needs two probes
        "ttft_p50": None,
        "ttft_p95": None,
        "rps": None,
        "vllm_series": ANY,
    }
    assert "vllm:num_requests_running" in first.metrics["vllm_series"]
    assert first.queue_length == 0
    assert first.last_probe_at is not None and first.last_error == ""
    assert first.scrape_state["prefix_queries"] == 0

    # The same 4-block prompt twice: the second finds 3 of its 4 blocks in the prefix cache
    # (as in vLLM, the last prompt token is always computed, so its block is never reused).
    prompt = " ".join(f"word{i}" for i in range(64))
    complete(sim.url, "m", prompt)
    complete(sim.url, "m", prompt)
    probe_workers()
    second = fresh(worker)
    assert second.metrics["prefix_hit_rate"] == pytest.approx(3 / 8)
    p50, p95 = second.metrics["ttft_p50"], second.metrics["ttft_p95"]
    assert p50 is not None and p95 is not None and 0 < p50 <= p95 < 1.0
    assert second.metrics["rps"] > 0
    assert second.last_probe_at is not None and second.last_probe_at > first.last_probe_at

    samples = list(WorkerSample.objects.filter(worker=worker))
    assert [s.up for s in samples] == [True, True]
    assert samples[0].prefix_hit_rate is None
    assert samples[1].prefix_hit_rate == pytest.approx(3 / 8)
    assert samples[1].running == 0 and samples[1].waiting == 0
    assert samples[1].ttft_p50 == pytest.approx(p50)


def test_one_generation_bump_per_round(simulator: StartSimulator) -> None:
    workers = [services.worker_add(url=simulator(f"m{i}").url, actor="test") for i in range(3)]
    before = RoutingGeneration.current()
    assert probe_workers() == len(workers)
    assert RoutingGeneration.current() == before + 1


def test_router_sees_the_new_queue_length_within_a_second(
    simulator: StartSimulator, add_worker: AddWorker, router: RouterServer, sim_loop: SimulatorLoop
) -> None:
    sim = simulator("busy", max_batch=1, ttft_ms=3000)
    worker = add_worker(sim)
    assert router.workers()[worker.pk]["queue_length"] is None

    async def request() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(
                f"{sim.url}/v1/completions", json={"model": "busy", "prompt": "hi", "max_tokens": 1}
            )

    pending = [asyncio.run_coroutine_threadsafe(request(), sim_loop.loop) for _ in range(3)]
    try:
        wait_until(lambda: (sim.state.running, sim.state.waiting) == (1, 2))
        probe_workers()
        probed = fresh(worker)
        assert (probed.metrics["running"], probed.metrics["waiting"]) == (1, 2)
        assert probed.queue_length == 3
        wait_until(lambda: router.workers()[worker.pk]["queue_length"] == 3, timeout=1.0)
    finally:
        for future in pending:
            future.cancel()  # disconnects: the simulator drops the requests
        concurrent.futures.wait(pending, timeout=5)


# --- failing, hanging and recovering workers ---------------------------------------------


def test_unhealthy_after_three_failed_probes_and_back_after_two(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")
    httpx.post(f"{sim.url}/sim/control", json={"healthy": False}).raise_for_status()

    for failures in (1, 2):
        probe_workers()
        probed = fresh(worker)
        assert probed.state == "active", f"unhealthy after {failures} failures"
        assert probed.consecutive_failures == failures
        assert probed.last_error == "/health answered HTTP 503"
    assert not events("worker_unhealthy", worker)

    before = RoutingGeneration.current()
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "unhealthy"
    (event,) = events("worker_unhealthy", worker)
    assert event.message == "3 failed probes: /health answered HTTP 503"
    assert event.actor == "probe"
    assert RoutingGeneration.current() >= before + 2  # the transition and the round
    assert not selectors.worker_view(probed, now=timezone.now()).routable
    # /metrics still answered, so the load signals stayed current.
    assert probed.metrics["running"] == 0
    assert [s.up for s in WorkerSample.objects.filter(worker=worker)] == [False] * 3

    httpx.post(f"{sim.url}/sim/control", json={"healthy": True}).raise_for_status()
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "unhealthy" and probed.consecutive_successes == 1
    assert probed.consecutive_failures == 0
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "active"
    (recovered,) = events("worker_recovered", worker)
    assert recovered.message == "2 successful probes"


def test_nothing_listening_is_connection_refused_and_metrics_unknown() -> None:
    worker = bare_worker(f"http://127.0.0.1:{free_port()}")
    for _ in range(3):
        probe_workers()
    probed = fresh(worker)
    assert probed.state == "unhealthy"
    assert events("worker_unhealthy", worker)[0].message == "3 failed probes: connection refused"
    assert probed.metrics == dict.fromkeys(probes.METRIC_KEYS)
    assert probed.queue_length is None


def test_a_hanging_worker_costs_the_round_one_timeout(
    simulator: StartSimulator, hanging_server: Callable[[], HangingServer]
) -> None:
    hung = [bare_worker(hanging_server().url) for _ in range(2)]
    healthy = [services.worker_add(url=simulator(f"m{i}").url, actor="test") for i in range(2)]

    started = time.monotonic()
    assert probe_workers() == 4
    elapsed = time.monotonic() - started
    # Timeout 1 s: the hanging servers' /health and /metrics all wait at the same time.
    assert 0.9 <= elapsed < 1.8, elapsed

    for worker in hung:
        probed = fresh(worker)
        assert probed.consecutive_failures == 1
        assert probed.last_error == "timed out after 1 s"
        assert probed.metrics["running"] is None
    for worker in healthy:
        probed = fresh(worker)
        assert probed.consecutive_successes == 1 and probed.metrics["running"] == 0


def test_probes_never_change_an_operators_state(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")
    Worker.objects.filter(pk=worker.pk).update(consecutive_failures=2)
    httpx.post(f"{sim.url}/sim/control", json={"healthy": False}).raise_for_status()

    # The probe ran while the worker was active; the operator drains it before the
    # result is applied. The result counts, but the drain stands.
    (result,) = probes.probe_many(health.probe_targets(), timeout=1.0)
    services.worker_drain(worker_id=worker.pk, actor="operator")
    assert health.probe_result_apply(result=result)
    probed = fresh(worker)
    assert probed.state in ("draining", "drained")
    assert probed.consecutive_failures == 3
    assert not events("worker_unhealthy", worker)

    probe_workers()  # and later rounds keep counting without touching the state
    probed = fresh(worker)
    assert probed.state in ("draining", "drained") and probed.consecutive_failures == 4
    assert probed.metrics["running"] == 0 and probed.last_probe_at is not None


# --- what servers export -----------------------------------------------------------------


def test_missing_metrics_stay_none(fake_vllm: Callable[..., FakeVllm]) -> None:
    empty = fake_vllm("empty")
    absent = fake_vllm("absent")
    absent.metrics_status = 404
    workers = [services.worker_add(url=f.url, actor="test") for f in (empty, absent)]
    for _ in range(2):
        probe_workers()
    for worker in workers:
        probed = fresh(worker)
        assert probed.state == "active" and probed.consecutive_successes == 2
        assert probed.metrics == dict.fromkeys(probes.METRIC_KEYS)
        assert probed.queue_length is None and probed.sleeping is None
        samples = list(WorkerSample.objects.filter(worker=worker))
        assert [(s.up, s.running, s.kv_cache_usage, s.rps) for s in samples] == [
            (True, None, None, None)
        ] * 2


def test_old_metric_names_are_read(fake_vllm: Callable[..., FakeVllm]) -> None:
    fake = fake_vllm(OLD_MODEL)
    fake.metrics_text = RECORDED_OLD
    worker = services.worker_add(url=fake.url, actor="test")
    probe_workers()
    fake.metrics_text = advance(
        RECORDED_OLD,
        {
            key("vllm:gpu_prefix_cache_queries_total", model_name=OLD_MODEL): 40,
            key("vllm:gpu_prefix_cache_hits_total", model_name=OLD_MODEL): 30,
        },
    )
    probe_workers()
    probed = fresh(worker)
    assert probed.metrics["kv_cache_usage"] == pytest.approx(0.62)
    assert probed.metrics["prefix_hit_rate"] == pytest.approx(0.75)
    assert probed.queue_length == 7


def test_a_sleeping_engine_leaves_the_rotation_and_comes_back(
    fake_vllm: Callable[..., FakeVllm],
) -> None:
    fake = fake_vllm("m")
    fake.metrics_text = sleep_lines(1, 0, 0)
    worker = services.worker_add(url=fake.url, actor="test")
    probe_workers()
    assert fresh(worker).sleeping is False
    assert not events("worker_awake", worker)  # nothing changed: it was never asleep

    fake.metrics_text = sleep_lines(0, 1, 0)
    before = RoutingGeneration.current()
    probe_workers()
    probed = fresh(worker)
    assert probed.sleeping is True and probed.state == "active"
    assert len(events("worker_sleeping", worker)) == 1
    assert RoutingGeneration.current() >= before + 2
    assert not selectors.worker_view(probed, now=timezone.now()).routable

    fake.metrics_text = ""  # the metric disappears: a sleeper must not slip back in
    probe_workers()
    assert fresh(worker).sleeping is True

    fake.metrics_text = sleep_lines(1, 0, 0)
    probe_workers()
    probed = fresh(worker)
    assert probed.sleeping is False
    assert len(events("worker_awake", worker)) == 1
    assert selectors.worker_view(probed, now=timezone.now()).routable


def test_models_refresh_picks_up_a_new_lora(
    simulator: StartSimulator, probe_settings: SettingsWrapper
) -> None:
    probe_settings.CONTROLPANEL_MODELS_EVERY = 2
    sim = simulator("base")
    worker = services.worker_add(url=sim.url, actor="test")
    asked = sim.state.by_path["/v1/models"]  # the discovery when it was added

    probe_workers()  # reads /v1/models: unchanged, so no event
    assert not events("models_changed", worker)
    load = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
    httpx.post(f"{sim.url}/v1/load_lora_adapter", json=load).raise_for_status()
    probe_workers()  # not due this time
    assert fresh(worker).model_ids == ["base"]

    before = RoutingGeneration.current()
    probe_workers()
    probed = fresh(worker)
    assert probed.model_ids == ["base", "sql-lora"]
    assert probed.models[1]["parent"] == "base"
    assert sim.state.by_path["/v1/models"] == asked + 2
    (event,) = events("models_changed", worker)
    assert event.message == "models now base, sql-lora; added sql-lora"
    assert ServedModel.objects.filter(name="sql-lora").exists()
    assert RoutingGeneration.current() >= before + 2


# --- routers' reports and housekeeping ---------------------------------------------------


def test_passive_failures_count_like_failed_probes(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")
    assert not health.worker_passive_failures(
        worker_id=worker.pk, failures=2, cause="connection refused"
    )
    assert fresh(worker).state == "active" and fresh(worker).consecutive_failures == 2

    before = RoutingGeneration.current()
    assert health.worker_passive_failures(
        worker_id=worker.pk, failures=1, cause="connection refused"
    )
    probed = fresh(worker)
    assert probed.state == "unhealthy" and probed.consecutive_successes == 0
    (event,) = events("worker_unhealthy", worker)
    assert event.message == "1 failed request: connection refused (3 failures in a row)"
    assert event.actor == "router"
    assert RoutingGeneration.current() == before + 1

    # Probes that succeed bring it back, as after failed probes.
    probe_workers()
    probe_workers()
    assert fresh(worker).state == "active"
    assert not health.worker_passive_failures(worker_id=10**9, failures=3, cause="reset")


def test_a_burst_of_refused_requests_needs_no_probe(simulator: StartSimulator) -> None:
    worker = services.worker_add(url=simulator("m").url, actor="test")
    assert health.worker_passive_failures(
        worker_id=worker.pk, failures=5, cause="connection reset by peer"
    )
    (event,) = events("worker_unhealthy", worker)
    assert event.message == "5 failed requests: connection reset by peer"


def test_old_samples_are_pruned() -> None:
    worker = bare_worker(f"http://127.0.0.1:{free_port()}")
    now = timezone.now()
    old = WorkerSample.objects.create(worker=worker, at=now - timedelta(minutes=31), up=True)
    recent = WorkerSample.objects.create(worker=worker, at=now - timedelta(minutes=29), up=True)
    probe_workers()
    kept = set(WorkerSample.objects.filter(worker=worker).values_list("pk", flat=True))
    assert old.pk not in kept and recent.pk in kept and len(kept) == 2


def test_beat_schedules_this_task(settings: SettingsWrapper) -> None:
    assert settings.CELERY_BEAT_SCHEDULE["probe-workers"]["task"] == probe_workers.name
    assert probe_workers.name == "controlpanel.probe_workers"
