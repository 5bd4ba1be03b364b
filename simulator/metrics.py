"""The engine's Prometheus ``/metrics`` page as vLLM 0.32 writes it: its metric names, help
texts, histogram buckets and labels (``engine="0",model_name=...``, sorted as vLLM sorts them),
every counter and histogram followed by its ``..._created`` gauge family, and the info series
``vllm:cache_config_info`` (vLLM's whole label set) and ``vllm:lora_requests_info``. Checked
against the pages captured from vLLM 0.32 (shared/vllm-captures/metrics-*.txt).

:class:`Metrics` holds the monotonic counters and histograms the engine updates;
:func:`render_metrics` writes them with the live gauges (running, waiting, KV-cache usage).
A prefill or decode server (``role``, :mod:`simulator.pd`) adds the NIXL connector's
families (``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred``, its failure and
expiry counters) and fills ``external_kv_transfer`` and the external prefix cache counters.
The families vLLM has but the simulator cannot fill (multi-modal cache, FLOPs, per-phase
times...) are left out rather than exported as zeros that would look measured.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol

from simulator.config import SimConfig

__all__ = ["EngineState", "Histogram", "Metrics", "go_float", "render_metrics"]

# vLLM's own bucket bounds, so dashboards built for vLLM read the simulator the same way.
_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# The NIXL connector's (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py): a
# transfer's time (its list from 0.001, without that first bound) and its bytes (2 KiB to
# 8 GiB, every other power of two).
_NIXL_TIME_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
)  # fmt: skip
_NIXL_BYTES_BUCKETS: tuple[float, ...] = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
Samples = Sequence[tuple[str, float]]  # (labels, value) of one family's samples
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def go_float(value: float) -> str:
    """A sample value as prometheus_client writes it (its floatToGoString): Python's repr,
    except that large numbers switch to an exponent sooner, as Go's do (1.79e+09)."""
    d = float(value)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6 and "e" not in s:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


class Histogram:
    """A Prometheus histogram kept as per-bucket counts (cumulated only when rendered)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, engine: str, model: str, created: float) -> list[str]:
        """The family, then its _created gauge; `le` sorts between engine and model_name."""
        labels = f"{engine},{model}"
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            acc += n
            le = go_float(bound)
            out.append(f'{self.name}_bucket{{{engine},le="{le}",{model}}} {go_float(acc)}')
        out.append(f"{self.name}_count{{{labels}}} {go_float(self.count)}")
        out.append(f"{self.name}_sum{{{labels}}} {go_float(self.sum)}")
        out += _created(self.name, self.help, [labels], created)
        return out


@dataclass
class Metrics:
    """Monotonic counters and histograms, as a vLLM engine exports them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    created: float = field(default_factory=time.time)  # every family's _created value
    # vllm:lora_requests_info: (running adapters, waiting adapters) -> when last seen. vLLM
    # sets the series of the current pair to the time at every engine step and never drops
    # the old ones, so each distinct pair seen stays a series.
    lora_seen: dict[tuple[str, str], float] = field(default_factory=dict)
    ttft: Histogram = field(
        default_factory=lambda: Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
    )
    itl: Histogram = field(
        default_factory=lambda: Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
    )
    e2e: Histogram = field(
        default_factory=lambda: Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _E2E_BUCKETS,
        )
    )
    queue: Histogram = field(
        default_factory=lambda: Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _E2E_BUCKETS,
        )
    )
    # Prefill/decode disaggregation (simulator.pd): prompt tokens a decode pulled, the
    # tokens it asked its connector for (every request's past its local hits), and the NIXL
    # connector's own series (only on a prefill or decode server's page).
    external_kv_tokens: int = 0
    external_queries: int = 0
    nixl_failed_transfers: int = 0
    nixl_expired: int = 0
    nixl_xfer: Histogram = field(
        default_factory=lambda: Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _NIXL_TIME_BUCKETS,
        )
    )
    nixl_bytes: Histogram = field(
        default_factory=lambda: Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _NIXL_BYTES_BUCKETS,
        )
    )


def _created(name: str, help_text: str, label_sets: list[str], created: float) -> list[str]:
    """A counter's or histogram's ``_created`` gauge family, as prometheus_client exports it
    beside the family (a counter's name without its ``_total``)."""
    base = name.removesuffix("_total") + "_created"
    out = [f"# HELP {base} {help_text}", f"# TYPE {base} gauge"]
    out += [f"{base}{{{labels}}} {go_float(created)}" for labels in label_sets]
    return out


def _family(kind: str, name: str, help_text: str, samples: Samples) -> list[str]:
    """One gauge or counter family; `samples` are (labels, value)."""
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    return out + [f"{name}{{{labels}}} {go_float(value)}" for labels, value in samples]


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class EngineState(Protocol):
    """What the page reads of an engine (:class:`simulator.engine.Simulator` is one): declared
    here so that this module need not import the engine, which imports it."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def config(self) -> SimConfig: ...

    @property
    def models(self) -> Sized: ...  # the base model and its adapters

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def deferred(self) -> int: ...  # waiting for their KV blocks (a decode's pull)

    def kv_usage(self) -> float: ...

    def note_lora_state(self) -> None: ...


def render_metrics(sim: EngineState) -> str:
    """The whole ``/metrics`` page of one engine, in vLLM's order of families."""
    m = sim.metrics
    engine, model = 'engine="0"', f'model_name="{_escape_label(sim.config.model)}"'
    labels = f"{engine},{model}"
    lines = _gauge_lines(sim, labels)
    lines += _counter_lines(sim, engine, model)
    for hist in (m.ttft, m.itl, m.e2e, m.queue):
        lines += hist.render(engine, model, m.created)
    if sim.config.role != "both":
        lines += _nixl_lines(sim, engine, model)
    lines += _lora_lines(sim)
    lines += _cache_config_lines(sim)
    return "\n".join(lines) + "\n"


def _gauge_lines(sim: EngineState, labels: str) -> list[str]:
    waiting = sim.waiting + sim.deferred
    by_reason = [
        (f'{labels},reason="capacity"', sim.waiting),
        (f'{labels},reason="deferred"', sim.deferred),
    ]
    sleep = [
        (f'{labels},sleep_state="awake"', 1),
        (f'{labels},sleep_state="weights_offloaded"', 0),
        (f'{labels},sleep_state="discard_all"', 0),
    ]
    return [
        *_family("gauge", "vllm:num_requests_running", _HELP["running"], [(labels, sim.running)]),
        *_family("gauge", "vllm:num_requests_waiting", _HELP["waiting"], [(labels, waiting)]),
        *_family("gauge", "vllm:num_requests_waiting_by_reason", _HELP["by_reason"], by_reason),
        *_family("gauge", "vllm:engine_sleep_state", _HELP["sleep"], sleep),
        *_family("gauge", "vllm:kv_cache_usage_perc", _HELP["usage"], [(labels, sim.kv_usage())]),
    ]


def _counter_lines(sim: EngineState, engine: str, model: str) -> list[str]:
    m = sim.metrics
    labels = f"{engine},{model}"
    computed = m.prompt_tokens - m.prefix_hits - m.external_kv_tokens
    by_source = [
        (f'{labels},source="local_compute"', computed),
        (f'{labels},source="local_cache_hit"', m.prefix_hits),
        (f'{labels},source="external_kv_transfer"', m.external_kv_tokens),
    ]
    finished = [
        (f'{engine},finished_reason="{r}",{model}', m.finished[r]) for r in FINISHED_REASONS
    ]
    counters: list[tuple[str, str, Samples]] = [
        ("vllm:prefix_cache_queries_total", "queries", [(labels, m.prefix_queries)]),
        ("vllm:prefix_cache_hits_total", "hits", [(labels, m.prefix_hits)]),
        ("vllm:external_prefix_cache_queries_total", "ext_queries", [(labels, m.external_queries)]),
        ("vllm:external_prefix_cache_hits_total", "ext_hits", [(labels, m.external_kv_tokens)]),
        ("vllm:num_preemptions_total", "preemptions", [(labels, 0)]),
        ("vllm:prompt_tokens_total", "prompt", [(labels, m.prompt_tokens)]),
        ("vllm:prompt_tokens_by_source_total", "by_source", by_source),
        (
            "vllm:prompt_tokens_cached_total",
            "cached",
            [(labels, m.prefix_hits + m.external_kv_tokens)],
        ),
        ("vllm:generation_tokens_total", "generation", [(labels, m.generation_tokens)]),
        ("vllm:request_success_total", "success", finished),
    ]
    lines: list[str] = []
    for name, key, samples in counters:
        lines += _family("counter", name, _HELP[key], samples)
        lines += _created(name, _HELP[key], [s[0] for s in samples], m.created)
    return lines


def _nixl_lines(sim: EngineState, engine: str, model: str) -> list[str]:
    """The NIXL connector's families, as a server with a connector exports them: the
    transfers' times and sizes (a decode's pulls), their failures, the leases that ran out
    (a prefill's). Its post times and descriptor counts are left out: nothing to fill them."""
    m = sim.metrics
    labels = f"{engine},{model}"
    lines = m.nixl_xfer.render(engine, model, m.created) + m.nixl_bytes.render(
        engine, model, m.created
    )
    counters = [
        ("vllm:nixl_num_failed_transfers_total", "nixl_failed", m.nixl_failed_transfers),
        ("vllm:nixl_num_failed_notifications_total", "nixl_notifications", 0),
        ("vllm:nixl_num_kv_expired_reqs_total", "nixl_expired", m.nixl_expired),
    ]
    for name, key, value in counters:
        lines += _family("counter", name, _HELP[key], [(labels, value)])
        lines += _created(name, _HELP[key], [labels], m.created)
    return lines


def _lora_lines(sim: EngineState) -> list[str]:
    """vLLM's ``lora_requests_info`` (with --enable-lora): labelled by max_lora and the
    running and waiting adapters only (no engine, no model_name), its value a time."""
    m = sim.metrics
    if len(sim.models) == 1 and not m.lora_seen:
        return []
    sim.note_lora_state()
    max_lora = sim.config.max_loras or max(1, len(sim.config.loras))
    samples = [
        (
            f'max_lora="{max_lora}",running_lora_adapters="{_escape_label(running)}",'
            f'waiting_lora_adapters="{_escape_label(waiting)}"',
            seen,
        )
        for (running, waiting), seen in m.lora_seen.items()
    ]
    return _family("gauge", "vllm:lora_requests_info", "Running stats on lora requests.", samples)


def _cache_config_lines(sim: EngineState) -> list[str]:
    """vLLM's CacheConfig as labels, every one vLLM 0.32 sends, sorted as it sorts them; the
    simulator's own values where it has them, vLLM's defaults for a GPU engine elsewhere."""
    cfg = sim.config
    tokens = cfg.cache_blocks * cfg.block_size
    info = {
        **_CACHE_CONFIG_DEFAULTS,
        "block_size": str(cfg.block_size),
        "cache_dtype": cfg.cache_dtype,
        "effective_attention_block_size": str(cfg.block_size),
        "engine": "0",
        "kv_cache_max_concurrency": repr(tokens / cfg.max_model_len),
        "kv_cache_size_tokens": str(tokens),
        "num_gpu_blocks": str(cfg.cache_blocks),
    }
    labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(info.items()))
    return _family("gauge", "vllm:cache_config_info", _HELP["cache_config"], [(labels, 1.0)])


_CACHE_CONFIG_DEFAULTS = {
    "_block_size_resolved": "True",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "False",
}

# vLLM 0.32's help texts, word for word.
_HELP = {
    "running": "Number of requests in model execution batches.",
    "waiting": "Number of requests waiting to be processed.",
    "by_reason": (
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
        "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
        "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting."
    ),
    "sleep": (
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
    ),
    "usage": "KV-cache usage. 1 means 100 percent usage.",
    "queries": "Prefix cache queries, in terms of number of queried tokens.",
    "hits": "Prefix cache hits, in terms of number of cached tokens.",
    "ext_queries": (
        "External prefix cache queries from KV connector cross-instance cache sharing, in "
        "terms of number of queried tokens."
    ),
    "ext_hits": (
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
        "of number of cached tokens."
    ),
    "preemptions": "Cumulative number of preemption from the engine.",
    "prompt": "Number of prefill tokens processed.",
    "by_source": "Number of prompt tokens by source.",
    "cached": "Number of cached prompt tokens (local + external).",
    "generation": "Number of generation tokens processed.",
    "success": "Count of successfully processed requests.",
    "cache_config": "Information of the LLMEngine CacheConfig",
    "nixl_failed": "Number of failed NIXL KV Cache transfers.",
    "nixl_notifications": "Number of failed NIXL KV Cache notifications.",
    "nixl_expired": (
        "Number of requests that had their KV expire. NOTE: This metric is tracked on the P "
        "instance."
    ),
}
