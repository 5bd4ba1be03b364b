"""The fake engine behind one simulated vLLM server: what a router cares about, without a GPU.

* **Queueing.** At most ``max_batch`` requests run (prefill + decode) at once; the rest wait in
  strict FIFO order. ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` report exactly
  that, and a running request holds ``ceil((prompt + max_tokens) / block_size)`` KV blocks, which
  is what ``vllm:kv_cache_usage_perc`` reports.
* **Prefix cache.** An LRU of physical blocks with chained hashes over the token ids, the
  prompt's as ``/tokenize`` answers them, then the generated ones
  (:mod:`simulator.prefix_cache`): a block only matches when the whole prefix up to it
  matches, and a LoRA does not share the base model's blocks. Only full blocks count, and, as
  in vLLM, the blocks that decoding fills are cached too. ``vllm:prefix_cache_queries_total`` /
  ``_hits_total`` count tokens, as vLLM does; with ``enable_prompt_tokens_details`` a
  request's ``usage`` says how many of its tokens were cached. With a KV events port, every
  store, eviction and reset is published as vLLM's KV cache events
  (:mod:`simulator.kv_publisher`).
* **Timing.** Once admitted, a request prefills for
  ``ttft_ms + prefill_ms_per_block * uncached_blocks``, which produces its first token; every
  further token takes ``itl_ms``. With ``ttft_ms == 0`` and ``itl_ms == 0`` the simulator never
  sleeps at all, so benchmarks of tiny requests measure the HTTP path only.
* **Prefill interference** (``prefill_interference_ms_per_block``, off at 0). vLLM's scheduler
  with chunked prefill runs one step at a time, each carrying every running decode's next
  token plus prompt chunks, and a step that carries prompt tokens takes longer: a long prefill
  slows every other request's tokens on the same engine. The approximation: while requests
  are prefilling here, each decode token's delay is ``itl_ms`` plus that many ms per uncached
  prompt block being prefilled on the engine when the token's wait starts
  (``prefilling_blocks``). Not modelled: the token budget of a step (all prefilling blocks
  count at once, however many prompts), the chunks' own slowdown (a prefill's time and a
  decode's ``itl_ms`` base do not depend on the batch), a change of the prefill load during
  one token's wait. A ``decode`` server's transferred prompts are not computed here, so they
  cause none; a ``both`` server's long prompts slow its chats' tokens.
* **Prefill/decode roles** (:mod:`simulator.pd`). A ``prefill`` server keeps a finished
  prefill leg's blocks (held, in ``kv_cache_usage_perc``) for a lease; a ``decode`` server
  pulls a decode leg's blocks from it while the request waits (``deferred``), then produces
  the first token in one ``itl_ms`` step instead of a prefill.

A client disconnect while a request waits, prefills or decodes removes it at once and records it
in ``cancelled`` / ``cancelled_ids`` (not in ``vllm:request_success_total``: vLLM does not count
a request its client abandoned). Every request except ``/metrics`` and ``/sim/*`` is logged
in ``Simulator.requests`` (method, path, headers, raw body); the tests read that log.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

import simulator.pd as pd
from simulator.config import SimConfig
from simulator.gpus import SimulatedGpus
from simulator.hf_tokenizer import HfTokenizer
from simulator.kv_publisher import KvEventPublisher
from simulator.metrics import Metrics
from simulator.prefix_cache import PrefixCache
from simulator.tokens import output_token_ids, token_ids
from simulator.wire import ApiError

__all__ = ["SIM_KEY", "Job", "Simulator"]


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
    cached_tokens: int | None = None  # usage.prompt_tokens_details (None: not reported)
    t_first: float = 0.0
    admitted: bool = False
    finished: bool = False
    produced: int = 0
    ids: list[int] = field(default_factory=list)  # the prompt's token ids
    hashes: list[int] = field(default_factory=list)  # its full blocks' hashes so far
    hit_tokens: int = 0  # the prompt's tokens found in the prefix cache
    held: bool = False  # holds its KV blocks (from admission, or from a decode's pull)
    # Prefill/decode (simulator.pd): the request's kv_transfer_params, whether a decode got
    # its prompt by transfer, and a prefill's kv_transfer_params for its answer.
    kv_params: Any = None
    chat: bool = False
    transferred: bool = False
    kv_answer: dict[str, Any] | None = None


class Simulator:
    """The state of one fake engine: FIFO admission, prefix cache, counters and request log."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.instant = config.ttft_ms == 0 and config.itl_ms == 0
        self.models: dict[str, str | None] = {config.model: None}
        self.models.update({name: config.model for name in config.loras})
        # /v1/models' root of each adapter: its lora_path (the name, for those given at start).
        self.lora_paths: dict[str, str] = {name: name for name in config.loras}
        self.healthy = True
        self.fail_ratio = config.fail_ratio
        self.fail_status = 500
        self.extra_ttft_ms = 0.0
        self.running = 0
        self.waiting = 0
        self.deferred = 0  # decodes pulling their blocks (waiting, as vLLM counts them)
        self.held_blocks = 0
        self.prefilling_blocks = 0  # uncached prompt blocks being prefilled right now
        self.lora_running: Counter[str] = Counter()
        self.lora_waiting: Counter[str] = Counter()
        self._queue: deque[asyncio.Future[None]] = deque()
        self.prefix_cache = PrefixCache(config.cache_blocks, config.block_size)
        # Set by simulator.server when the config has a KV events port.
        self.kv_events: KvEventPublisher | None = None
        self.gpus = SimulatedGpus(config.gpus)
        self.tokenizer = HfTokenizer(config.tokenizer) if config.tokenizer else None
        # Prefill/decode (simulator.pd): this engine's id, where its blocks are pulled from
        # (simulator.server sets the port it listens on), the blocks it keeps for decodes.
        self.engine_id = str(uuid.uuid4())
        self.side_channel = (config.side_channel_host or "127.0.0.1", 0)
        self.leases = pd.Leases(config.kv_lease_s, config.cache_blocks, self._lease_released)
        self._pull_session: aiohttp.ClientSession | None = None
        self.reset()

    def reset(self) -> None:
        """Clear counters, metrics, the request log and the prefix cache (not live requests)."""
        self.received = 0
        self.completed = 0
        self.cancelled = 0
        self.peak_running = self.running  # the most requests in the batch at once, since
        self.injected_failures = 0
        self.fail_debt = 0.0  # simulator.generation.injects_failure's running share
        self.cancelled_ids: list[str] = []
        self.by_path: Counter[str] = Counter()
        self.requests: deque[dict[str, Any]] = deque(maxlen=200)
        self.metrics = Metrics()
        self.reset_prefix_cache()

    def note_lora_state(self) -> None:
        """vllm:lora_requests_info's series for the adapters running and waiting now, set to
        the time, as vLLM sets it at every engine step (so a pair seen once stays a series)."""
        if len(self.models) == 1 and not self.metrics.lora_seen:
            return
        running = ",".join(sorted(k for k, v in self.lora_running.items() if v > 0))
        waiting = ",".join(sorted(k for k, v in self.lora_waiting.items() if v > 0))
        self.metrics.lora_seen[(running, waiting)] = time.time()

    def reset_prefix_cache(self) -> None:
        self._publish(self.prefix_cache.clear())

    def _publish(self, events: list[Any]) -> None:
        if events and self.kv_events is not None:
            self.kv_events.publish(events)

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

    async def _acquire(self, *, first: bool = False) -> None:
        """A batch slot, in FIFO order; `first` goes to the head of the queue (a decode whose
        blocks arrived, as vLLM puts back the requests it skipped)."""
        if self.running < self.config.max_batch and not self._queue:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if first:
            self._queue.appendleft(fut)
        else:
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

    def _cached_prefix_blocks(self, job: Job) -> int:
        """Count the leading cached full blocks, then cache the prompt's other full blocks."""
        job.ids = token_ids(job.tokens)
        lora = job.model if job.lora else None
        hits, job.hashes, events = self.prefix_cache.prefill(lora, job.ids)
        self._publish(events)
        return hits

    def decoded(self, job: Job) -> None:
        """Cache the blocks that decoding has filled, as vLLM does after each step. The
        newest token's KV is not computed yet (it is fed in at the next step), hence the -1."""
        bs = self.config.block_size
        full = (len(job.ids) + job.produced - 1) // bs
        if full <= len(job.hashes):
            return
        tokens = job.ids + output_token_ids(full * bs - len(job.ids))
        first = len(job.hashes)
        parent = job.hashes[-1] if job.hashes else None
        lora = job.model if job.lora else None
        job.hashes += self.prefix_cache.hashes(parent, tokens[first * bs : full * bs], lora)
        self._publish(self.prefix_cache.store(lora, tokens, job.hashes, first))

    async def admit(self, job: Job) -> None:
        """Wait for a batch slot, then prefill; returns when the first token exists. A
        decode with a remote prefill pulls its blocks first (simulator.pd)."""
        loop = asyncio.get_running_loop()
        job.t0 = loop.time()
        remote = pd.remote_prefill(job.kv_params) if self.config.role == "decode" else None
        if job.lora:
            self.lora_waiting[job.model] += 1
            self.note_lora_state()
        try:
            hits = await self._pull(job, remote) if remote is not None else None
            await self._acquire(first=remote is not None)
        finally:
            if job.lora:
                self.lora_waiting[job.model] -= 1
        job.admitted = True
        self._hold(job)
        if job.lora:
            self.lora_running[job.model] += 1
            self.note_lora_state()
        now = loop.time()
        self.metrics.queue.observe(now - job.t0)
        await self._prefill(job, hits)
        job.t_first = loop.time()
        job.produced = 1
        self.metrics.ttft.observe(job.t_first - job.t0)

    def _hold(self, job: Job) -> None:
        if not job.held:
            job.held = True
            self.held_blocks += job.blocks

    def _look_up(self, job: Job) -> int:
        """The prompt's leading cached blocks, counted (the prompt's others are cached)."""
        n, bs = len(job.tokens), self.config.block_size
        hits = self._cached_prefix_blocks(job)
        job.hit_tokens = hits * bs
        if self.config.enable_prompt_tokens_details:
            job.cached_tokens = hits * bs
        m = self.metrics
        m.prompt_tokens += n
        m.prefix_queries += n
        m.prefix_hits += hits * bs
        if self.config.role != "both":
            m.external_queries += n - hits * bs  # what the connector is asked for
        return hits

    async def _prefill(self, job: Job, hits: int | None) -> None:
        """The prompt's computation, which produces the first token: after a transfer, one
        decode step (the prompt's last token, for its logits)."""
        if hits is None:
            hits = self._look_up(job)
        if self.instant:
            return
        delay, uncached = self.extra_ttft_ms, 0
        if job.transferred:
            delay += self.config.itl_ms
        else:
            uncached = len(job.tokens) // self.config.block_size - hits
            delay += self.config.ttft_ms + self.config.prefill_ms_per_block * uncached
        if delay <= 0:
            return
        self.prefilling_blocks += uncached
        try:
            await asyncio.sleep(delay / 1000)
        finally:
            self.prefilling_blocks -= uncached

    def token_delay_s(self) -> float:
        """The wait for a decode's next token, from now: ``itl_ms``, plus the prefill
        interference of the prompts prefilling on this engine now (module docstring)."""
        if self.instant:
            return 0.0
        cfg = self.config
        return (cfg.itl_ms + cfg.prefill_interference_ms_per_block * self.prefilling_blocks) / 1000

    async def decode_tokens(self, count: int) -> None:
        """Wait while `count` more tokens are decoded (a whole answer's, after the first)."""
        if count <= 0 or self.instant:
            return
        if not self.config.prefill_interference_ms_per_block:
            if self.config.itl_ms > 0:
                await asyncio.sleep(count * self.config.itl_ms / 1000)
            return
        for _ in range(count):
            if delay := self.token_delay_s():
                await asyncio.sleep(delay)

    async def _pull(self, job: Job, remote: pd.RemotePrefill) -> int:
        """A decode's prompt blocks from the prefill that computed them, waiting (deferred)
        and holding its blocks meanwhile. Returns its local prefix hits."""
        cfg, m = self.config, self.metrics
        n, bs = len(job.tokens), cfg.block_size
        hits = self._look_up(job)
        self._hold(job)
        self.deferred += 1
        try:
            held = await pd.pull_blocks(self._pull_client(), remote)
            if held is None:
                m.nixl_failed_transfers += 1  # the prompt is computed here instead
            else:
                blocks = -(-n // bs) - hits
                seconds = blocks * cfg.kv_transfer_ms_per_block / 1000
                if seconds > 0 and not self.instant:
                    await asyncio.sleep(seconds)
                job.transferred = True
                m.external_kv_tokens += n - hits * bs
                m.nixl_xfer.observe(seconds)
                m.nixl_bytes.observe(blocks * bs * cfg.kv_bytes_per_token)
                if job.cached_tokens is not None:
                    job.cached_tokens = n  # vLLM's own count: local hits and transferred
        finally:
            self.deferred -= 1
        cached = pd.reported_cached_tokens(job.kv_params, n)
        if job.cached_tokens is not None and cached is not None:
            job.cached_tokens = cached
        return hits

    def _pull_client(self) -> aiohttp.ClientSession:
        """One client for every pull, made in the server's loop on the first one."""
        if self._pull_session is None:
            connector = aiohttp.TCPConnector(limit=pd.PULL_CONNECTIONS)
            self._pull_session = aiohttp.ClientSession(connector=connector, timeout=pd.PULL_TIMEOUT)
        return self._pull_session

    def _lease_released(self, blocks: int, expired: bool) -> None:
        self.held_blocks -= blocks
        if expired:
            self.metrics.nixl_expired += 1

    def _lease(self, job: Job) -> None:
        """A prefill's finished request keeps its blocks for a decode (simulator.pd)."""
        num_tokens = len(job.tokens) + job.produced - 1  # the newest token's KV is not made
        rid = pd.internal_request_id(job.id, job.chat)
        ids = self.leases.grant(rid, num_tokens, self.config.block_size)
        self.held_blocks += len(ids)
        host, port = self.side_channel
        job.kv_answer = pd.prefill_params(
            block_ids=ids,
            engine_id=self.engine_id,
            request_id=rid,
            host=host,
            port=port,
            num_tokens=num_tokens,
            cached_tokens=job.hit_tokens,
        )

    async def close(self) -> None:
        """The server stops: leases end, the pull client closes."""
        self.leases.close()
        if self._pull_session is not None:
            await self._pull_session.close()
            self._pull_session = None

    # -- bookkeeping -------------------------------------------------------------------------

    def complete(self, job: Job, now: float) -> None:
        job.finished = True
        self.completed += 1
        m = self.metrics
        m.finished["length"] += 1
        m.e2e.observe(now - job.t0)
        if job.produced > 1:
            m.itl.observe((now - job.t_first) / (job.produced - 1), job.produced - 1)
        if self.config.role == "prefill" and pd.asks_remote_decode(job.kv_params):
            self._lease(job)

    def cancel(self, job: Job) -> None:
        if job.finished:
            return
        job.finished = True
        # No vllm:request_success_total{finished_reason="abort"}: vLLM does not count a
        # request whose client went away (checked against vLLM 0.32).
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
        if job.held:
            job.held = False
            self.held_blocks -= job.blocks
        if not job.admitted:
            return
        job.admitted = False
        if job.lora:
            self.lora_running[job.model] -= 1
            self.note_lora_state()
        self._release_slot()

    # -- views -------------------------------------------------------------------------------

    def check_model(self, name: Any) -> str:
        if name is None:
            return self.config.model
        if name not in self.models:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Valid aliases: {self.config.model}.",
                "model",
            )
        return str(name)

    def kv_usage(self) -> float:
        """The share of the KV cache that running requests hold (0..1)."""
        cfg = self.config
        return min(1.0, self.held_blocks / cfg.cache_blocks) if cfg.cache_blocks else 0.0

    def stats(self) -> dict[str, Any]:
        recent = list(self.requests)[-50:]
        return {
            "received": self.received,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "cancelled_ids": self.cancelled_ids,
            "running": self.running,
            "waiting": self.waiting,
            "deferred": self.deferred,
            "held_blocks": self.held_blocks,
            "kv_leases": len(self.leases),
            "by_path": dict(self.by_path),
            "requests": [
                {**r, "body": r["body"].decode("utf-8", errors="replace")} for r in recent
            ],
        }


SIM_KEY: web.AppKey[Simulator] = web.AppKey("simulator", Simulator)
