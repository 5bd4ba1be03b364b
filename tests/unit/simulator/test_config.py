"""simulator.config: the command line both entry points share, turned into a SimConfig."""

from __future__ import annotations

import argparse

import pytest

from simulator.config import ROLES, SimConfig, add_cli_arguments, config_from_options


def parsed(*argv: str) -> SimConfig:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return config_from_options(vars(parser.parse_args(["--port", "1", *argv])))


def test_no_option_gives_the_default_config() -> None:
    assert parsed() == SimConfig()


def test_every_option_reaches_its_field() -> None:
    config = parsed(
        "--model", "m", "--lora", "a", "--lora", "b", "--ttft-ms", "1.5", "--itl-ms", "2",
        "--max-batch", "3", "--cache-blocks", "64", "--block-size", "8", "--max-loras", "2",
        "--max-model-len", "512", "--fail-ratio", "0.25", "--gpus", "4", "--api-key", "k",
        "--vllm-version", "0.32.0", "--cache-dtype", "fp8", "--enable-prompt-tokens-details",
        "--kv-events-port", "5557", "--kv-events-replay-port", "5558", "--kv-events-legacy",
        "--kv-events-buffer", "7", "--role", "decode", "--kv-lease-s", "0",
        "--kv-transfer-ms-per-block", "0", "--kv-bytes-per-token", "2",
        "--side-channel-host", "10.0.0.1", "--prefill-interference-ms-per-block", "0.5",
    )  # fmt: skip
    assert config == SimConfig(
        model="m", loras=("a", "b"), ttft_ms=1.5, itl_ms=2.0, max_batch=3, cache_blocks=64,
        block_size=8, max_loras=2, max_model_len=512, fail_ratio=0.25, gpus=4, api_key="k",
        version="0.32.0", cache_dtype="fp8", enable_prompt_tokens_details=True,
        kv_events_port=5557, kv_events_replay_port=5558, kv_events_legacy=True,
        kv_events_buffer=7, role="decode", kv_lease_s=0.0, kv_transfer_ms_per_block=0.0,
        kv_bytes_per_token=2, side_channel_host="10.0.0.1",
        prefill_interference_ms_per_block=0.5,
    )  # fmt: skip


def test_options_missing_from_a_partial_dict_take_the_defaults() -> None:
    """manage.py's callers may pass only the required options."""
    required = {"model": "m", "ttft_ms": 1.0, "prefill_ms_per_block": 2.0, "itl_ms": 3.0,
                "max_batch": 4, "cache_blocks": 5, "block_size": 6, "max_model_len": 7,
                "default_max_tokens": 8}  # fmt: skip
    config = config_from_options(required)
    assert (config.role, config.version, config.gpus) == ("both", "sim", 1)
    assert config.kv_events_buffer == SimConfig.kv_events_buffer and config.loras == ()


def test_an_unknown_role_is_refused_by_the_config_and_the_command_line() -> None:
    assert ROLES == ("both", "prefill", "decode")
    with pytest.raises(ValueError, match="role must be one of"):
        SimConfig(role="router")
    with pytest.raises(SystemExit):
        parsed("--role", "router")
