"""The engine's Prometheus ``/metrics`` page, in vLLM's metric names, help texts and histogram
buckets, so dashboards and probes built for vLLM read the simulator the same way.

:class:`Metrics` holds the monotonic counters and histograms the engine updates;
:func:`render_metrics` writes them, with the live gauges (running, waiting, KV-cache usage)
and the info series (cache config, LoRA adapters), in the text exposition format.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulator.engine import Simulator

__all__ = ["Histogram", "Metrics", "render_metrics"]

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

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            acc += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{self.name}_bucket{{le="{le}",{labels}}} {float(acc)!r}')
        out.append(f"{self.name}_count{{{labels}}} {float(self.count)!r}")
        out.append(f"{self.name}_sum{{{labels}}} {self.sum!r}")
        return out


@dataclass
class Metrics:
    """Monotonic counters and histograms, as a vLLM engine exports them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: Counter[str] = field(default_factory=Counter)
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
            "Histogram of inter-token latency.",
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


def _sample(kind: str, name: str, help_text: str, labels: str, value: float) -> list[str]:
    # prometheus_client names a counter family with its _total suffix, and so does vLLM.
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value!r}"]


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(sim: Simulator) -> str:
    """The whole ``/metrics`` page of one engine."""
    m = sim.metrics
    labels = f'model_name="{_escape_label(sim.config.model)}",engine="0"'
    lines = _gauge_and_counter_lines(sim, labels)
    lines += _success_lines(m.finished, labels)
    for hist in (m.ttft, m.itl, m.e2e, m.queue):
        lines += hist.render(labels)
    lines += _info_lines(sim)
    return "\n".join(lines) + "\n"


def _gauge_and_counter_lines(sim: Simulator, labels: str) -> list[str]:
    m = sim.metrics
    gauges = {
        "vllm:num_requests_running": ("Requests in the running batch.", sim.running),
        "vllm:num_requests_waiting": ("Requests waiting for a batch slot.", sim.waiting),
        "vllm:kv_cache_usage_perc": ("KV-cache usage (1 means 100 percent).", sim.kv_usage()),
    }
    counters = {
        "vllm:prefix_cache_queries_total": ("Prefix cache queries, in tokens.", m.prefix_queries),
        "vllm:prefix_cache_hits_total": ("Prefix cache hits, in tokens.", m.prefix_hits),
        "vllm:prompt_tokens_total": ("Number of prefill tokens processed.", m.prompt_tokens),
        "vllm:generation_tokens_total": ("Number of generated tokens.", m.generation_tokens),
    }
    lines: list[str] = []
    for kind, family in (("gauge", gauges), ("counter", counters)):
        for name, (help_text, value) in family.items():
            lines += _sample(kind, name, help_text, labels, float(value))
    return lines


def _success_lines(finished: Counter[str], labels: str) -> list[str]:
    lines = [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in ("stop", "length", "abort"):
        value = float(finished[reason])
        lines.append(f'vllm:request_success_total{{finished_reason="{reason}",{labels}}} {value!r}')
    return lines


def _info_lines(sim: Simulator) -> list[str]:
    cfg = sim.config
    lines = [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        (
            f'vllm:cache_config_info{{block_size="{cfg.block_size}",'
            f'cache_dtype="{_escape_label(cfg.cache_dtype)}",'
            f'enable_prefix_caching="True",num_gpu_blocks="{cfg.cache_blocks}"}} 1.0'
        ),
    ]
    if len(sim.models) > 1:
        running = ",".join(sorted(k for k, v in sim.lora_running.items() if v > 0))
        waiting = ",".join(sorted(k for k, v in sim.lora_waiting.items() if v > 0))
        lines += [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            (
                f'vllm:lora_requests_info{{max_lora="{len(sim.models) - 1}",'
                f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} '
                f"{time.time()!r}"
            ),
        ]
    return lines
