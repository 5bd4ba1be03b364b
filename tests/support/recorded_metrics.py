# ruff: noqa: E501 - the recorded /metrics samples below keep vLLM's own long lines
"""/metrics pages recorded from vLLM, one with today's metric names and one with the older
`gpu_*` names, and the same server a few seconds later; the probe's parsing is checked on
them (tests/unit/controlpanel/fleet/test_probes.py) and fake vLLM servers serve them
(tests/e2e/test_probe_exports.py)."""

from __future__ import annotations

import re

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


def key(name: str, **labels: str) -> str:
    """A sample line's name and labels as the recorded texts spell them (labels sorted)."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def advance(text: str, increments: dict[str, float]) -> str:
    """The same server a few seconds later: the given samples grew by the given amounts."""

    def grow(match: re.Match[str]) -> str:
        value = float(match.group(2)) + increments.get(match.group(1), 0.0)
        return f"{match.group(1)} {value!r}"

    return re.sub(r"^(\S+) (\S+)$", grow, text, flags=re.MULTILINE)


def sleep_lines(awake: float, offloaded: float, discarded: float) -> str:
    labels = 'engine="0",model_name="m"'
    return (
        f'vllm:engine_sleep_state{{{labels},sleep_state="awake"}} {awake}\n'
        f'vllm:engine_sleep_state{{{labels},sleep_state="weights_offloaded"}} {offloaded}\n'
        f'vllm:engine_sleep_state{{{labels},sleep_state="discard_all"}} {discarded}\n'
    )
