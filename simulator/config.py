"""One simulated vLLM server's knobs (:class:`SimConfig`) and the command-line options that set
them, shared by ``manage.py simulate_vllm`` and ``python -m simulator``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["ROLES", "SimConfig", "add_cli_arguments", "config_from_options"]

# Prefill/decode disaggregation (simulator.pd): what a vLLM server started with a NIXL
# connector does, "prefill" as kv_producer, "decode" as kv_consumer; "both" has no connector.
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class SimConfig:
    """Knobs of one simulated vLLM server (times in milliseconds)."""

    model: str = "sim-model"
    loras: tuple[str, ...] = ()
    ttft_ms: float = 20.0
    prefill_ms_per_block: float = 2.0
    itl_ms: float = 5.0
    max_batch: int = 8
    cache_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 4096
    # vLLM's --max-loras, vllm:lora_requests_info's max_lora (0: as many as `loras`, >= 1).
    max_loras: int = 0
    default_max_tokens: int = 16
    # Fault injection, for rollout gates and chaos tests: this fraction of generation
    # requests is answered with vLLM's 500 error; /sim/control changes it and
    # `extra_ttft_ms` (a slow version) while the server runs.
    fail_ratio: float = 0.0
    gpus: int = 1  # simulated GPUs on /dcgm-metrics
    # vLLM's --api-key: every /v1 path then needs `Authorization: Bearer <key>` (401 else).
    api_key: str = ""
    # What GET /version answers, and the KV cache's dtype in vllm:cache_config_info: with
    # --block-size and --max-model-len, what pool preflight compares between workers.
    version: str = "sim"
    cache_dtype: str = "auto"
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False
    # vLLM's --kv-events-config: publish KV cache events on this port (0: off), with a
    # replay socket on kv_events_replay_port (0: none); `legacy`: 2025's array encoding.
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_events_legacy: bool = False
    kv_events_buffer: int = 10_000  # batches kept for replay (vLLM's buffer_steps)
    # A Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json): token ids and
    # chat templates as vLLM makes them (simulator.hf_tokenizer); "": one token per word.
    tokenizer: str = ""
    # Prefill/decode disaggregation (simulator.pd). A prefill keeps a request's blocks for
    # `kv_lease_s` (vLLM's kv_lease_duration) or until a decode pulls them; a decode pulls
    # them over HTTP in `kv_transfer_ms_per_block` each, `kv_bytes_per_token` of KV a token
    # (Llama 3 8B's in bf16). The host a prefill's answers name ("": the one it listens on).
    role: str = "both"
    kv_lease_s: float = 30.0
    kv_transfer_ms_per_block: float = 0.5
    kv_bytes_per_token: int = 131_072
    side_channel_host: str = ""
    # Prefill interference (simulator.engine's "Timing"), off at 0: while prompts are being
    # computed on this engine, every decode token takes this many ms more per block of them.
    prefill_interference_ms_per_block: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``manage.py simulate_vllm`` and ``python -m simulator``."""
    d = SimConfig()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--lora", action="append", default=[], help="LoRA name (repeatable)")
    parser.add_argument("--ttft-ms", type=float, default=d.ttft_ms)
    parser.add_argument("--prefill-ms-per-block", type=float, default=d.prefill_ms_per_block)
    parser.add_argument("--itl-ms", type=float, default=d.itl_ms)
    parser.add_argument("--max-batch", type=int, default=d.max_batch)
    parser.add_argument("--cache-blocks", type=int, default=d.cache_blocks)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--max-loras", type=int, default=d.max_loras, help="vLLM's --max-loras")
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    parser.add_argument(
        "--fail-ratio", type=float, default=d.fail_ratio, help="fraction answered with 500"
    )
    parser.add_argument("--gpus", type=int, default=d.gpus, help="GPUs on /dcgm-metrics")
    parser.add_argument("--api-key", default=d.api_key, help="require this key on /v1 (vLLM's)")
    # Not --version: manage.py's commands keep that for Django's own.
    parser.add_argument(
        "--vllm-version", dest="version", default=d.version, help="what GET /version answers"
    )
    parser.add_argument("--cache-dtype", default=d.cache_dtype, help="vllm:cache_config_info's")
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens, as vLLM's flag",
    )
    parser.add_argument(
        "--kv-events-port", type=int, default=0, help="publish KV cache events here (ZeroMQ)"
    )
    parser.add_argument(
        "--kv-events-replay-port", type=int, default=0, help="the KV events replay socket"
    )
    parser.add_argument(
        "--kv-events-legacy", action="store_true", help="2025's array encoding of the events"
    )
    parser.add_argument(
        "--kv-events-buffer", type=int, default=d.kv_events_buffer, help="batches kept for replay"
    )
    parser.add_argument(
        "--tokenizer", default="", help="a local Hugging Face tokenizer folder (default: words)"
    )
    parser.add_argument(
        "--role", choices=ROLES, default=d.role, help="prefill/decode disaggregation's role"
    )
    parser.add_argument(
        "--kv-lease-s", type=float, default=d.kv_lease_s, help="a prefill keeps blocks this long"
    )
    parser.add_argument(
        "--kv-transfer-ms-per-block",
        type=float,
        default=d.kv_transfer_ms_per_block,
        help="a decode's pull time per block",
    )
    parser.add_argument(
        "--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token, help="KV size per token"
    )
    parser.add_argument(
        "--side-channel-host",
        default=d.side_channel_host,
        help="the host a prefill's answers name (default: the one it listens on)",
    )
    parser.add_argument(
        "--prefill-interference-ms-per-block",
        type=float,
        default=d.prefill_interference_ms_per_block,
        help="a decode token's extra ms per prompt block prefilling on the engine (0: off)",
    )


def config_from_options(options: dict[str, Any]) -> SimConfig:
    """Build a SimConfig from parsed options (argparse names, dashes as underscores)."""
    return SimConfig(
        model=options["model"],
        loras=tuple(options.get("lora") or ()),
        ttft_ms=options["ttft_ms"],
        prefill_ms_per_block=options["prefill_ms_per_block"],
        itl_ms=options["itl_ms"],
        max_batch=options["max_batch"],
        cache_blocks=options["cache_blocks"],
        block_size=options["block_size"],
        max_model_len=options["max_model_len"],
        max_loras=options.get("max_loras") or 0,
        default_max_tokens=options["default_max_tokens"],
        fail_ratio=options.get("fail_ratio", 0.0),
        gpus=options.get("gpus", SimConfig.gpus),
        api_key=options.get("api_key") or "",
        version=options.get("version") or SimConfig.version,
        cache_dtype=options.get("cache_dtype") or SimConfig.cache_dtype,
        enable_prompt_tokens_details=bool(options.get("enable_prompt_tokens_details")),
        kv_events_port=options.get("kv_events_port") or 0,
        kv_events_replay_port=options.get("kv_events_replay_port") or 0,
        kv_events_legacy=bool(options.get("kv_events_legacy")),
        kv_events_buffer=options.get("kv_events_buffer") or SimConfig.kv_events_buffer,
        tokenizer=options.get("tokenizer") or "",
        role=options.get("role") or SimConfig.role,
        kv_lease_s=options.get("kv_lease_s", SimConfig.kv_lease_s),
        kv_transfer_ms_per_block=options.get(
            "kv_transfer_ms_per_block", SimConfig.kv_transfer_ms_per_block
        ),
        kv_bytes_per_token=options.get("kv_bytes_per_token") or SimConfig.kv_bytes_per_token,
        side_channel_host=options.get("side_channel_host") or "",
        prefill_interference_ms_per_block=options.get("prefill_interference_ms_per_block") or 0.0,
    )
