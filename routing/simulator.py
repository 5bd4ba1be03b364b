"""A fake vLLM OpenAI-compatible server for demos, tests and throughput benchmarks.

It speaks vLLM's wire format (``/v1/models``, chat and text completions with SSE streaming,
embeddings, ``/tokenize``, ``/detokenize``, ``/health``, Prometheus ``/metrics``) without a GPU,
and models the three things a router cares about:

* **Queueing.** At most ``max_batch`` requests run (prefill + decode) at once; the rest wait in
  strict FIFO order. ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` report exactly
  that, and a running request holds ``ceil((prompt + max_tokens) / block_size)`` KV blocks, which
  is what ``vllm:kv_cache_usage_perc`` reports.
* **Prefix cache.** An LRU of block hashes. Block *i*'s hash chains block *i-1*'s hash with the
  block's tokens (seeded by the requested model name, so a LoRA does not share the base model's
  cache), hence a block only matches when the whole prefix up to it matches. Only full blocks
  count. ``vllm:prefix_cache_queries_total`` / ``_hits_total`` count tokens, as vLLM does.
* **Timing.** Once admitted, a request prefills for
  ``ttft_ms + prefill_ms_per_block * uncached_blocks``, which produces its first token; every
  further token takes ``itl_ms``. With ``ttft_ms == 0`` and ``itl_ms == 0`` the simulator never
  sleeps at all, so benchmarks of tiny requests measure the HTTP path only.

Tokens are whitespace-separated words (chat: each message's role, then its text). Output is a
deterministic cycle of filler words, always ``max_tokens`` long (finish reason ``length``).

Test hooks: the header ``X-Sim-Delay-Ms: N`` delays a request by N ms before anything is sent
(including the response headers). Every request except ``/metrics`` and ``/sim/*`` is logged in
``Simulator.requests`` (method, path, headers, raw body), and ``/sim/stats``, ``/sim/reset`` and
``/sim/control`` expose and steer the state over HTTP. A client disconnect while a request waits,
prefills or decodes removes it at once and records it in ``cancelled`` / ``cancelled_ids``.
``/dcgm-metrics`` serves the server's simulated GPUs (``gpus`` of them) as NVIDIA's DCGM
exporter would (routing.simulated_gpus).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import signal
import time
from bisect import bisect_left
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
from aiohttp import web

from routing.simulated_gpus import SimulatedGpus

__all__ = [
    "RunningSimulator",
    "SimConfig",
    "Simulator",
    "add_cli_arguments",
    "build_app",
    "config_from_options",
    "run_simulator",
    "start_simulator",
]


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
    default_max_tokens: int = 16
    # Fault injection, for rollout gates and chaos tests: this fraction of generation
    # requests is answered with vLLM's 500 error; /sim/control changes it and
    # `extra_ttft_ms` (a slow version) while the server runs.
    fail_ratio: float = 0.0
    gpus: int = 1  # simulated GPUs on /dcgm-metrics
    # vLLM's --api-key: every /v1 path then needs `Authorization: Bearer <key>` (401 else).
    api_key: str = ""


# --------------------------------------------------------------------------- tokens and text

_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
    "seven", "wizards", "quietly", "hum", "a", "lively", "tune", "about", "packing", "boxes",
)  # fmt: skip
_WORDS_B = tuple(w.encode() + b" " for w in _WORDS)
_VOCAB_CAP = 1 << 16

# Bounded so that benchmarks with random prompts cannot grow memory without limit;
# words past the cap all map to <unk>.
_vocab: dict[str, int] = {"<unk>": 0}
_vocab_words: list[str] = ["<unk>"]


@lru_cache(maxsize=256)
def _output_text(n: int) -> str:
    """The first n filler tokens, each a word followed by a space."""
    return "".join(_WORDS[i % len(_WORDS)] + " " for i in range(n))


def _token_id(word: str) -> int:
    tid = _vocab.get(word)
    if tid is None:
        if len(_vocab_words) >= _VOCAB_CAP:
            return 0
        tid = _vocab[word] = len(_vocab_words)
        _vocab_words.append(word)
    return tid


def _detokenize(ids: Iterable[int]) -> str:
    n = len(_vocab_words)
    return " ".join(_vocab_words[i] if 0 <= i < n else "<unk>" for i in ids)


class ApiError(Exception):
    """A client error, answered in vLLM's OpenAI error format."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> web.Response:
        err_type = {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "Error")
        return _error(self.status, self.message, err_type, self.param)


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return _json(body, status)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _parse_body(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"JSON decode error: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return data


def _chat_tokens(messages: Any) -> list[Hashable]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list.", "messages")
    tokens: list[Hashable] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise ApiError(400, "Each message must be an object.", "messages")
        tokens.append(str(msg.get("role", "")))
        content = msg.get("content")
        if isinstance(content, str):
            tokens.extend(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    tokens.extend(str(part.get("text", "")).split())
    return tokens


def _prompt_tokens(prompt: Any) -> list[Hashable]:
    """Tokens of a completions prompt: str, list[str], list[int] or list[list[int]]."""
    if isinstance(prompt, str):
        return list(prompt.split())
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return list(prompt)
        tokens: list[Hashable] = []
        for part in prompt:
            if isinstance(part, str):
                tokens.extend(part.split())
            elif isinstance(part, list) and all(isinstance(t, int) for t in part):
                tokens.extend(part)
            else:
                break
        else:
            return tokens
    raise ApiError(400, "`prompt` must be a string, a list of strings or of token ids.", "prompt")


def _max_tokens(value: Any, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, "max_tokens must be an integer >= 1.", "max_tokens")
    return value


# --------------------------------------------------------------------------- metrics

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


# --------------------------------------------------------------------------- engine state


@dataclass(slots=True)
class Job:
    """One generation request as the fake engine schedules it."""

    id: str
    model: str
    lora: bool
    tokens: list[Hashable]
    max_tokens: int
    stream: bool
    include_usage: bool
    blocks: int
    t0: float = 0.0
    t_first: float = 0.0
    admitted: bool = False
    finished: bool = False
    produced: int = 0


class Simulator:
    """The state of one fake engine: FIFO admission, prefix cache, counters and request log."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.instant = config.ttft_ms == 0 and config.itl_ms == 0
        self.models: dict[str, str | None] = {config.model: None}
        self.models.update({name: config.model for name in config.loras})
        self.healthy = True
        self.fail_ratio = config.fail_ratio
        self.fail_status = 500
        self.extra_ttft_ms = 0.0
        self.running = 0
        self.waiting = 0
        self.held_blocks = 0
        self.lora_running: Counter[str] = Counter()
        self.lora_waiting: Counter[str] = Counter()
        self._queue: deque[asyncio.Future[None]] = deque()
        self._cache: OrderedDict[int, None] = OrderedDict()
        self.gpus = SimulatedGpus(config.gpus)
        self.reset()

    def reset(self) -> None:
        """Clear counters, metrics, the request log and the prefix cache (not live requests)."""
        self.received = 0
        self.completed = 0
        self.cancelled = 0
        self.injected_failures = 0
        self.cancelled_ids: list[str] = []
        self.by_path: Counter[str] = Counter()
        self.requests: deque[dict[str, Any]] = deque(maxlen=200)
        self.metrics = Metrics()
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self._cache.clear()

    # -- request prologue ------------------------------------------------------------------

    async def begin(self, request: web.Request) -> bytes:
        """Read the body and log the request; the tests read the log."""
        body = await request.read() if request.body_exists else b""
        path = request.path
        self.by_path[path] += 1
        if path != "/metrics":
            # str() because aiohttp's header names are istr, which orjson refuses as keys.
            headers = {str(k): v for k, v in request.headers.items()}
            entry = {"method": request.method, "path": path, "headers": headers, "body": body}
            self.requests.append(entry)
        return body

    # -- FIFO admission ----------------------------------------------------------------------

    async def _acquire(self) -> None:
        if self.running < self.config.max_batch and not self._queue:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        self.waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just before the cancel landed: pass it on.
                self._release_slot()
            else:
                self.waiting -= 1
                if fut in self._queue:
                    self._queue.remove(fut)
            raise

    def _release_slot(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                # The slot moves straight to the oldest waiter, so `running` is unchanged and
                # a newcomer cannot overtake it.
                self.waiting -= 1
                fut.set_result(None)
                return
        self.running -= 1

    # -- prefill -----------------------------------------------------------------------------

    def _cached_prefix_blocks(self, seed: str, tokens: list[Hashable]) -> int:
        """Count the leading cached full blocks, then cache (or refresh) every full block."""
        bs = self.config.block_size
        cache = self._cache
        toks = tuple(tokens)
        h = hash(seed)
        hits = 0
        for i in range(len(toks) // bs):
            h = hash((h, toks[i * bs : (i + 1) * bs]))
            if hits == i and h in cache:
                hits += 1
            cache[h] = None
            cache.move_to_end(h)
        for _ in range(len(cache) - self.config.cache_blocks):
            cache.popitem(last=False)
        return hits

    async def admit(self, job: Job) -> None:
        """Wait for a batch slot, then prefill; returns when the first token exists."""
        loop = asyncio.get_running_loop()
        job.t0 = loop.time()
        if job.lora:
            self.lora_waiting[job.model] += 1
        try:
            await self._acquire()
        finally:
            if job.lora:
                self.lora_waiting[job.model] -= 1
        job.admitted = True
        self.held_blocks += job.blocks
        if job.lora:
            self.lora_running[job.model] += 1
        now = loop.time()
        self.metrics.queue.observe(now - job.t0)
        await self._prefill(job)
        job.t_first = loop.time()
        job.produced = 1
        self.metrics.ttft.observe(job.t_first - job.t0)

    async def _prefill(self, job: Job) -> None:
        n = len(job.tokens)
        hits = self._cached_prefix_blocks(job.model, job.tokens)
        m = self.metrics
        m.prompt_tokens += n
        m.prefix_queries += n
        m.prefix_hits += hits * self.config.block_size
        if self.instant:
            return
        uncached = n // self.config.block_size - hits
        delay = self.config.ttft_ms + self.extra_ttft_ms
        delay += self.config.prefill_ms_per_block * uncached
        if delay > 0:
            await asyncio.sleep(delay / 1000)

    # -- bookkeeping -------------------------------------------------------------------------

    def complete(self, job: Job, now: float) -> None:
        job.finished = True
        self.completed += 1
        m = self.metrics
        m.finished["length"] += 1
        m.e2e.observe(now - job.t0)
        if job.produced > 1:
            m.itl.observe((now - job.t_first) / (job.produced - 1), job.produced - 1)

    def cancel(self, job: Job) -> None:
        if job.finished:
            return
        job.finished = True
        self.metrics.finished["abort"] += 1
        self.record_cancel(job.id)

    def record_cancel(self, request_id: str) -> None:
        self.cancelled += 1
        self.cancelled_ids.append(request_id)
        if len(self.cancelled_ids) > 2000:
            # Long benchmarks must not grow memory; tests only look at the recent ids.
            del self.cancelled_ids[:1000]

    def release(self, job: Job) -> None:
        """Give back the batch slot and KV blocks; safe to call whatever happened before."""
        self.metrics.generation_tokens += job.produced
        job.produced = 0
        if not job.admitted:
            return
        job.admitted = False
        self.held_blocks -= job.blocks
        if job.lora:
            self.lora_running[job.model] -= 1
        self._release_slot()

    # -- views -------------------------------------------------------------------------------

    def check_model(self, name: Any) -> str:
        if name is None:
            return self.config.model
        if name not in self.models:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")
        return str(name)

    def stats(self) -> dict[str, Any]:
        recent = list(self.requests)[-50:]
        return {
            "received": self.received,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "cancelled_ids": self.cancelled_ids,
            "running": self.running,
            "waiting": self.waiting,
            "by_path": dict(self.by_path),
            "requests": [
                {**r, "body": r["body"].decode("utf-8", errors="replace")} for r in recent
            ],
        }

    def render_metrics(self) -> str:
        cfg = self.config
        labels = f'model_name="{_escape_label(cfg.model)}",engine="0"'
        m = self.metrics
        lines: list[str] = []
        usage = min(1.0, self.held_blocks / cfg.cache_blocks) if cfg.cache_blocks else 0.0
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch.", self.running),
            "vllm:num_requests_waiting": ("Requests waiting for a batch slot.", self.waiting),
            "vllm:kv_cache_usage_perc": ("KV-cache usage (1 means 100 percent).", usage),
        }
        counters = {
            "vllm:prefix_cache_queries_total": (
                "Prefix cache queries, in tokens.",
                m.prefix_queries,
            ),
            "vllm:prefix_cache_hits_total": ("Prefix cache hits, in tokens.", m.prefix_hits),
            "vllm:prompt_tokens_total": ("Number of prefill tokens processed.", m.prompt_tokens),
            "vllm:generation_tokens_total": ("Number of generated tokens.", m.generation_tokens),
        }
        for kind, family in (("gauge", gauges), ("counter", counters)):
            for name, (help_text, value) in family.items():
                lines += _sample(kind, name, help_text, labels, float(value))
        lines += [
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort"):
            value = float(m.finished[reason])
            lines.append(
                f'vllm:request_success_total{{finished_reason="{reason}",{labels}}} {value!r}'
            )
        for hist in (m.ttft, m.itl, m.e2e, m.queue):
            lines += hist.render(labels)
        lines += self._info_lines()
        return "\n".join(lines) + "\n"

    def _info_lines(self) -> list[str]:
        cfg = self.config
        lines = [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            (
                f'vllm:cache_config_info{{block_size="{cfg.block_size}",'
                f'enable_prefix_caching="True",num_gpu_blocks="{cfg.cache_blocks}"}} 1.0'
            ),
        ]
        if len(self.models) > 1:
            running = ",".join(sorted(k for k, v in self.lora_running.items() if v > 0))
            waiting = ",".join(sorted(k for k, v in self.lora_waiting.items() if v > 0))
            lines += [
                "# HELP vllm:lora_requests_info Running stats on lora requests.",
                "# TYPE vllm:lora_requests_info gauge",
                (
                    f'vllm:lora_requests_info{{max_lora="{len(self.models) - 1}",'
                    f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} '
                    f"{time.time()!r}"
                ),
            ]
        return lines


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


SIM_KEY: web.AppKey[Simulator] = web.AppKey("simulator", Simulator)


# --------------------------------------------------------------------------- generation


def _delay_s(request: web.Request) -> float:
    raw = request.headers.get("X-Sim-Delay-Ms")
    if not raw:
        return 0.0
    try:
        return max(0.0, float(raw)) / 1000
    except ValueError:
        return 0.0


def _request_id(request: web.Request, prefix: str) -> str:
    # vLLM builds its request id from the client's X-Request-Id when there is one.
    rid = request.headers.get("X-Request-Id") or os.urandom(16).hex()
    return f"{prefix}-{rid}"


def _make_job(sim: Simulator, request: web.Request, data: dict[str, Any], chat: bool) -> Job:
    cfg = sim.config
    model = sim.check_model(data.get("model"))
    if chat:
        tokens = _chat_tokens(data.get("messages"))
        raw_max = data.get("max_completion_tokens")
        raw_max = data.get("max_tokens") if raw_max is None else raw_max
    else:
        tokens = _prompt_tokens(data.get("prompt"))
        raw_max = data.get("max_tokens")
    max_tokens = _max_tokens(raw_max, cfg.default_max_tokens)
    if len(tokens) + max_tokens > cfg.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
            f"requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    stream = bool(data.get("stream", False))
    options = data.get("stream_options")
    if options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    blocks = -(-(len(tokens) + max_tokens) // cfg.block_size)
    rid = _request_id(request, "chatcmpl" if chat else "cmpl")
    lora = model != cfg.model
    return Job(rid, model, lora, tokens, max_tokens, stream, include_usage, blocks)


def _usage(job: Job) -> dict[str, Any]:
    prompt = len(job.tokens)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + job.max_tokens,
        "completion_tokens": job.max_tokens,
        "prompt_tokens_details": None,
    }


def _final_body(job: Job, chat: bool) -> dict[str, Any]:
    text = _output_text(job.max_tokens)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    return {
        "id": job.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": [choice],
        "usage": _usage(job),
    }


async def _respond_whole(sim: Simulator, job: Job, chat: bool, delay: float) -> web.Response:
    loop = asyncio.get_running_loop()
    try:
        if delay:
            await asyncio.sleep(delay)
        await sim.admit(job)
        if job.max_tokens > 1 and not sim.instant and sim.config.itl_ms > 0:
            await asyncio.sleep((job.max_tokens - 1) * sim.config.itl_ms / 1000)
        job.produced = job.max_tokens
        sim.complete(job, loop.time())
    except asyncio.CancelledError:
        sim.cancel(job)
        raise
    finally:
        sim.release(job)
    return _json(_final_body(job, chat))


class _Frames:
    """Pre-encoded SSE pieces of one stream, so a token costs a few byte concatenations."""

    def __init__(self, job: Job, chat: bool) -> None:
        self.job = job
        self.chat = chat
        self.created = int(time.time())
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        head = b'data: {"id":' + orjson.dumps(job.id) + b',"object":"' + obj
        head += b'","created":' + str(self.created).encode()
        head += b',"model":' + orjson.dumps(job.model) + b',"choices":[{"index":0,'
        self.head = head
        self.pre = head + (b'"delta":{"content":"' if chat else b'"text":"')
        self.mid = (b'"}' if chat else b'"') + b',"logprobs":null,"finish_reason":'
        self.tail = b',"stop_reason":null}]}\n\n'

    def first(self) -> bytes:
        token = self.token(0)
        if not self.chat:
            return token
        role = self.head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
        return role + b'"finish_reason":null}]}\n\n' + token

    def token(self, i: int) -> bytes:
        last = i == self.job.max_tokens - 1
        word = _WORDS_B[i % len(_WORDS_B)]
        frame = self.pre + word + self.mid + (b'"length"' if last else b"null") + self.tail
        return frame + self.end() if last else frame

    def end(self) -> bytes:
        done = b"data: [DONE]\n\n"
        if not self.job.include_usage:
            return done
        # vLLM writes this chunk with exclude_none: no `"prompt_tokens_details": null`.
        usage: dict[str, Any] = {
            "id": self.job.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.job.model,
            "choices": [],
            "usage": {k: v for k, v in _usage(self.job).items() if v is not None},
        }
        return b"data: " + orjson.dumps(usage) + b"\n\n" + done


_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


async def _respond_stream(
    sim: Simulator, request: web.Request, job: Job, chat: bool, delay: float
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    try:
        if delay:
            await asyncio.sleep(delay)
        # Headers go out at once, as with vLLM behind uvicorn; the body starts at first token.
        await resp.prepare(request)
        await sim.admit(job)
        await _decode(sim, job, resp, _Frames(job, chat))
        sim.complete(job, loop.time())
        await resp.write_eof()
    except asyncio.CancelledError:
        sim.cancel(job)
        raise
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError subclasses this: the client went away mid-write.
        sim.cancel(job)
    finally:
        sim.release(job)
    return resp


async def _decode(sim: Simulator, job: Job, resp: web.StreamResponse, frames: _Frames) -> None:
    await resp.write(frames.first())
    itl = 0.0 if sim.instant else sim.config.itl_ms / 1000
    for i in range(1, job.max_tokens):
        if itl:
            await asyncio.sleep(itl)
        await resp.write(frames.token(i))
        job.produced += 1


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    body = await sim.begin(request)
    delay = _delay_s(request)
    try:
        job = _make_job(sim, request, _parse_body(body), chat)
    except ApiError as exc:
        if delay:
            await asyncio.sleep(delay)
        return exc.response()
    sim.received += 1
    if sim.fail_ratio and random.random() < sim.fail_ratio:
        sim.injected_failures += 1
        return _error(sim.fail_status, "injected failure (simulator fail_ratio)", "SimulatedError")
    if job.stream:
        return await _respond_stream(sim, request, job, chat, delay)
    return await _respond_whole(sim, job, chat, delay)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


# --------------------------------------------------------------------------- other endpoints

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _api(fn: Callable[[Simulator, web.Request, bytes], Awaitable[web.StreamResponse]]) -> Handler:
    """Wrap a handler with the common prologue: log, X-Sim-Delay-Ms, ApiError -> JSON error."""

    async def handler(request: web.Request) -> web.StreamResponse:
        sim = request.app[SIM_KEY]
        body = await sim.begin(request)
        delay = _delay_s(request)
        if delay:
            await asyncio.sleep(delay)
        try:
            return await fn(sim, request, body)
        except ApiError as exc:
            return exc.response()

    return handler


def _embedding(item: Any) -> list[float]:
    raw = item.encode() if isinstance(item, str) else orjson.dumps(item)
    digest = hashlib.blake2b(raw, digest_size=64).digest()
    values = [v / 32768 for v in memoryview(digest).cast("h")]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _embedding_inputs(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value]
        if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            return value
    raise ApiError(400, "`input` must be a string, a list of strings or of token ids.", "input")


@_api
async def embeddings(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = _parse_body(body)
    model = sim.check_model(data.get("model"))
    inputs = _embedding_inputs(data.get("input"))
    sim.received += 1
    rid = _request_id(request, "embd")
    if not sim.instant and sim.config.ttft_ms > 0:
        try:
            await asyncio.sleep(sim.config.ttft_ms / 4000)
        except asyncio.CancelledError:
            sim.record_cancel(rid)
            raise
    sim.completed += 1
    n_tokens = sum(len(i.split()) if isinstance(i, str) else len(i) for i in inputs)
    items = [
        {"object": "embedding", "index": i, "embedding": _embedding(item)}
        for i, item in enumerate(inputs)
    ]
    usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}
    return _json(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": items,
            "usage": usage,
        }
    )


@_api
async def tokenize(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = _parse_body(body)
    sim.check_model(data.get("model"))
    if "messages" in data:
        words = _chat_tokens(data["messages"])
    else:
        words = _prompt_tokens(data.get("prompt"))
    ids = [w if isinstance(w, int) else _token_id(str(w)) for w in words]
    return _json(
        {
            "count": len(ids),
            "max_model_len": sim.config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    )


@_api
async def detokenize(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data = _parse_body(body)
    sim.check_model(data.get("model"))
    ids = data.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ApiError(400, "`tokens` must be a list of token ids.", "tokens")
    return _json({"prompt": _detokenize(ids)})


@_api
async def models(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": sim.created,
            "owned_by": "vllm",
            "root": name,
            "parent": parent,
            "max_model_len": sim.config.max_model_len,
            "permission": [],
        }
        for name, parent in sim.models.items()
    ]
    return _json({"object": "list", "data": data})


@_api
async def load_lora(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    name = _parse_body(body).get("lora_name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "`lora_name` is required.", "lora_name")
    if name in sim.models:
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
    sim.models[name] = sim.config.model
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


@_api
async def unload_lora(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    name = _parse_body(body).get("lora_name")
    if not isinstance(name, str) or name == sim.config.model or name not in sim.models:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
    del sim.models[name]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


@_api
async def health(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return web.Response(status=200 if sim.healthy else 503)


@_api
async def ping(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return web.Response(status=200 if sim.healthy else 503)


@_api
async def version(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return _json({"version": "sim"})


@_api
async def load(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    return _json({"server_load": sim.running + sim.waiting})


@_api
async def metrics(sim: Simulator, request: web.Request, body: bytes) -> web.StreamResponse:
    text = sim.render_metrics()
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


@_api
async def reset_prefix_cache(sim: Simulator, request: web.Request, body: bytes) -> web.Response:
    # A vLLM dev-mode endpoint: present so router tests can check it is never exposed.
    sim.reset_prefix_cache()
    return web.Response()


async def dcgm_metrics(request: web.Request) -> web.Response:
    # Not logged with the requests: like /metrics, it is scraped, not served.
    sim = request.app[SIM_KEY]
    cfg = sim.config
    load = sim.running / cfg.max_batch if cfg.max_batch else 0.0
    kv_usage = min(1.0, sim.held_blocks / cfg.cache_blocks) if cfg.cache_blocks else 0.0
    text = sim.gpus.render(load=load, kv_usage=kv_usage, now=time.time())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def sim_stats(request: web.Request) -> web.Response:
    return _json(request.app[SIM_KEY].stats())


async def sim_reset(request: web.Request) -> web.Response:
    request.app[SIM_KEY].reset()
    return _json({"ok": True})


async def sim_control(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    try:
        data = _parse_body(await request.read())
    except ApiError as exc:
        return exc.response()
    if "healthy" in data:
        sim.healthy = bool(data["healthy"])
    if "fail_ratio" in data:
        sim.fail_ratio = min(1.0, max(0.0, float(data["fail_ratio"])))
    if "extra_ttft_ms" in data:
        sim.extra_ttft_ms = max(0.0, float(data["extra_ttft_ms"]))
    if "fail_status" in data:
        sim.fail_status = int(data["fail_status"])
    sim.gpus.control(data)
    return _json(
        {"healthy": sim.healthy, "fail_ratio": sim.fail_ratio, "extra_ttft_ms": sim.extra_ttft_ms}
    )


# --------------------------------------------------------------------------- app and runners


def _api_key_middleware(key: str) -> Any:
    """vLLM's AuthenticationMiddleware: /v1 paths need the key; /health, /metrics do not."""
    expected = f"Bearer {key}"

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1") and request.headers.get("Authorization") != expected:
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def build_app(config: SimConfig) -> web.Application:
    """An aiohttp application serving one simulated vLLM engine."""
    middlewares = [_api_key_middleware(config.api_key)] if config.api_key else []
    app = web.Application(client_max_size=64 * 1024**2, middlewares=middlewares)
    app[SIM_KEY] = Simulator(config)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/load_lora_adapter", load_lora)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dcgm-metrics", dcgm_metrics)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_post("/sim/reset", sim_reset)
    app.router.add_post("/sim/control", sim_control)
    return app


@dataclass
class RunningSimulator:
    """A simulator listening on a port; ``state`` is its live :class:`Simulator`."""

    runner: web.AppRunner
    port: int
    url: str
    state: Simulator

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 2.0
) -> RunningSimulator:
    """Start serving in the running event loop; port 0 picks a free port."""
    app = build_app(config)
    # handler_cancellation: a client disconnect must cancel the handler, as vLLM aborts the
    # request. access_log=None: no per-request logging in benchmarks.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    return RunningSimulator(runner, bound, f"http://{shown}:{bound}", app[SIM_KEY])


async def _serve(config: SimConfig, host: str, port: int) -> None:
    sim = await start_simulator(config, host, port)
    print(f"simulated vLLM {config.model} on {sim.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sim.stop()


def run_simulator(config: SimConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM (blocking)."""
    asyncio.run(_serve(config, host, port))


# --------------------------------------------------------------------------- command line


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``manage.py simulate_vllm`` and ``python -m routing.simulator``."""
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
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    parser.add_argument(
        "--fail-ratio", type=float, default=d.fail_ratio, help="fraction answered with 500"
    )
    parser.add_argument("--gpus", type=int, default=d.gpus, help="GPUs on /dcgm-metrics")
    parser.add_argument("--api-key", default=d.api_key, help="require this key on /v1 (vLLM's)")


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
        default_max_tokens=options["default_max_tokens"],
        fail_ratio=options.get("fail_ratio", 0.0),
        gpus=options.get("gpus", SimConfig.gpus),
        api_key=options.get("api_key") or "",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a simulated vLLM server.")
    add_cli_arguments(parser)
    options = vars(parser.parse_args(argv))
    run_simulator(config_from_options(options), options["host"], options["port"])


if __name__ == "__main__":
    main()
