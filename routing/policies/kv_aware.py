"""KV aware: send a request where the fewest of its prompt's blocks must be computed, with load.

prefix_aware guesses what a worker's prefix cache holds from the router's own traffic; it
cannot know that a worker evicted a prefix, restarted, or served someone else. vLLM itself
publishes every block it stores and evicts (KV cache events), and every router subscribes
to every worker's events into an exact index (routing.kv.kv_index). This policy routes on that
index, on the request's token ids as the worker will see them (routing.prompt.tokenize).

The rule (NVIDIA Dynamo's KV router cost, with our fused load as the decode term)
--------------------------------------------------------------------------------
For each worker ``w`` given, with ``n`` prompt tokens and ``B`` = ``block_size``, the
cost's unit (not a worker's block size):

    cached(w)  = prompt tokens w holds: its leading cached blocks (exact, from its KV
                 events) times its own block size
    prefill(w) = (n - cached(w)) / B        the prompt blocks w would have to compute
    cost(w)    = overlap_weight * prefill(w) + load_weight * load(w)

and the cheapest worker wins (on a tie the less loaded, then at random). A worker's
``cached`` is what its events show plus the blocks right after them that this router
credited it with at decisions whose answers have not started yet
(routing.policies.kv_pending): the index learns a prompt's blocks only once the worker has
stored them, so without the credit a burst of requests sharing a new prefix would all miss
and be spread over every worker, each computing the same prefix. ``load`` is
routing.policies.load's fused signal (every router's requests in flight on the worker plus
what it reported beyond them), the same in every router. Dynamo writes
``overlap_score_weight * prefill_blocks + decode_blocks``, its decode term being the KV
blocks of the worker's active sequences; the router knows requests, not their blocks, so
``load_weight`` says how many blocks of prefill one request in flight is worth.
Decision ``"kv"``; ``"pending"`` when some of the winner's cached blocks are this router's
credit rather than its events; ``"miss"`` when no worker holds any block of the prompt (the
cost is then the load alone, so the least loaded wins). A LoRA adapter's blocks are looked up
under its name (the index keys them apart from the base model's, as vLLM does).

Then the load guard, prefix_aware's (the same ``skewed`` behaviour): if the winner is
overloaded, i.e. ``load - min_load > balance_abs_threshold`` *and* ``load >
balance_rel_threshold * min_load``, the least loaded worker takes the request instead:
decision ``"load"``. A hot prefix would otherwise queue on its holders whenever its prefill
saving outweighs any queue the weights allow.

Fallback: never silent
----------------------
A worker whose index answers None (no KV events configured, a gap not replayed yet, a
restart not rebuilt: never trusted stale) is scored from prefix_aware's approximate index
instead: ``cached(w)`` = the share of the prompt its tree matches (bytes, at chunk
granularity) times ``n``, and the winner, when it is such a worker, is credited there as
prefix_aware credits (and shared with other routers the same way). Decision ``"fallback"``
when the winner was scored so. A request without token ids (no tokenizer could make them
exactly, see routing.prompt.tokenize) is routed by prefix_aware's whole rule on the approximate
index, decision ``"fallback"``. Each fallback is counted by reason in `fallbacks`
(``no_tokens``; ``unknown_index``: one per request with at least one worker scored
approximately), exported on /metrics as
``controlpanel_router_kv_aware_fallbacks_total{model,reason}``; the approximate index only
remembers requests sent to workers without an exact index, so it costs nothing while every
worker has events (and a worker whose index has just turned unknown starts there with
nothing: an under-estimate, never a false hit).

Block sizes: each worker's own, never assumed. vLLM states it in every ``BlockStored``
(the index keeps it per worker) and in ``vllm:cache_config_info`` (the probes scrape it:
WorkerView.kv_block_size); the events' wins. vLLM on CPUs uses 128 tokens, GPU backends 16
or more, and a fleet may mix them: each worker's blocks are matched, credited and predicted
in its own size. A worker whose size neither source has stated yet holds nothing the index
knows of (its first store will state it); the pending credit skips it, counted as the
fallback reason ``block_size_unknown``.

Prediction: the Choice's `prediction` is the cached tokens the winner should report, its
``cached`` in whole blocks and at most ``(n - 1) // b * b`` (``b`` its block size: vLLM
computes at least the prompt's last token), checked against the answer by
routing.telemetry.cache_check.

Knobs (the served model's policy_config; an unknown key or a bad value is a ValueError)
---------------------------------------------------------------------------------------
``overlap_weight`` (number >= 0, default 1.0)
    Dynamo's ``overlap_score_weight``: how much a prompt block to compute costs. Higher
    favours cache reuse (time to first token); lower, an even load (inter-token latency).
    0 is shortest queue.
``load_weight`` (number >= 0, default 8)
    How many prompt blocks (of ``block_size`` tokens) one request in flight is worth: a
    worker holding 128 more tokens of the prompt (at the default unit of 16) is worth one
    more request in its queue.
    0 routes on the cache alone (the guard still spills a hot spot).
``balance_abs_threshold`` (number >= 0, default 32) and ``balance_rel_threshold`` (number
>= 1, default 1.1)
    The load guard above, as prefix_aware's: set the first to about one batch of the
    workers (e.g. 8 for workers that run 8 sequences at once).
``block_size`` (int >= 1, default 16)
    The unit the cost counts prompt tokens in, so that the weights above keep one meaning
    whatever the workers' block sizes (which are always their own, see "Block sizes").
``miss_spread`` (number >= 0, default 0)
    prefix_aware's (routing.policies.agreed_miss): a miss goes to the worker the prompt's
    middle block ranks first among those within this many requests of the least loaded, so
    routers put a new prefix on one worker although each credits only its own decisions
    until the worker's events show the blocks (a whole prefill later). Also given to the
    approximate index's fallback. Off by default, for prefix_aware's reason (its cost on
    misses); at 2, two replicas on ``prefix`` went from 1.40x to 1.30x the oracle's mean
    TTFT, one router unchanged (bench/RESULTS.md).
``pending_seconds`` (number >= 0, default 10.0)
    The longest the chosen worker is credited with a request's blocks past those its
    events show (up to the prompt's 256th) while its answer has not started: about the
    longest a request waits for a batch slot. The credit ends sooner, 50 ms after the
    answer's first byte (the worker's events have shown the blocks by then), or when the
    attempt fails. 0 routes on the events alone. The credit is this router's; other
    routers see the blocks from the events.

Cost (bench/kv_aware_cost/run.py, bench/RESULTS.md): on a 4k-word prompt at 8 workers about
111 µs p50 on the 2-core bench machine, 127 µs when another request's live credit of the
same prompt is compared (83 µs before the credit existed); mostly one walk of the prompt's chain
for all workers (routing.kv.kv_holders: each block hashed once, only as far as some worker
holds the prefix, one lookup per block for all). Tokenization, apart, costs 30-50 times
that. Not thread-safe (one router, one event loop) and no I/O: tokens come with the
request.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.kv.kv_index import KvIndex, LoraKey, chain_seed
from routing.policies.agreed_miss import agreed_position
from routing.policies.base import (
    NO_WORKER,
    BasePolicy,
    Choice,
    Explanation,
    PolicyContext,
    Prediction,
    RequestInfo,
    capped_guard,
)
from routing.policies.kv_pending import LazyChain, PendingBlocks
from routing.policies.load import check_keys, integer, number
from routing.policies.prefix_aware import PrefixAwarePolicy
from routing.policies.prefix_trees import held_depth
from routing.policies.request_text import request_text

_KNOBS = ("overlap_weight", "load_weight", "balance_abs_threshold", "balance_rel_threshold",
          "block_size", "pending_seconds", "miss_spread")  # fmt: skip


class ApproximateIndex(PrefixAwarePolicy):
    """prefix_aware's index, read per worker, for the workers the exact index cannot tell."""

    def chain(self, request: RequestInfo) -> list[int]:
        text = request.text if request.text is not None else request_text(request.body)
        return self._chain(text)

    def held_share(self, worker_id: int, hashes: list[int]) -> float:
        """The share of the last chained prompt (bytes) that the worker's tree matches."""
        tree = self._trees.get(worker_id)
        depth = held_depth(tree, hashes, 0) if tree is not None and hashes else 0
        if not depth:
            return 0.0
        return min(self._ends[depth - 1], self._chained_bytes) / self._chained_bytes

    def credit_chain(self, worker_id: int, hashes: list[int]) -> None:
        """Credit a routed prompt to the worker, as prefix_aware's select does."""
        if not hashes:
            return
        now = float(self._clock())
        self._insert(worker_id, hashes, now, None)
        if self.outbox is not None:
            self.outbox.append((worker_id, hashes))
        self._sweep(worker_id, now, 32 + len(hashes))


class _Scored:
    """One worker's numbers for one request: the prompt tokens it holds (whole blocks of
    its `size`), whether that is exact, its load and its cost."""

    __slots__ = ("cached", "cost", "exact", "load", "pending", "size", "sized", "worker")

    def __init__(
        self, worker: WorkerView, cached: float, size: int, exact: bool, load: int, cost: float
    ) -> None:
        self.worker, self.cached, self.size, self.exact, self.load, self.cost = (
            worker, cached, size, exact, load, cost
        )  # fmt: skip
        self.pending = False  # some of its cached tokens are this router's credit
        self.sized = True  # False: `size` is the cost's unit, the worker's own not known


class KvAwarePolicy(BasePolicy):
    name = "kv_aware"
    shares = True
    needs_request_tokens = True
    default_decision = "kv"

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(config)
        cfg, name = self.config, self.name
        check_keys(name, cfg, _KNOBS)
        self.overlap_weight = number(name, cfg, "overlap_weight", 1.0, minimum=0.0)
        self.load_weight = number(name, cfg, "load_weight", 8.0, minimum=0.0)
        self.balance_abs_threshold = number(name, cfg, "balance_abs_threshold", 32, minimum=0.0)
        self.balance_rel_threshold = number(name, cfg, "balance_rel_threshold", 1.1, minimum=1.0)
        self._guard_abs = self.balance_abs_threshold  # under the model's cap (attach)
        self.block_size = integer(name, cfg, "block_size", 16, minimum=1)
        pending_seconds = number(name, cfg, "pending_seconds", 10.0, minimum=0.0)
        self.miss_spread = number(name, cfg, "miss_spread", 0.0, minimum=0.0)
        self._rng = rng or random.Random()
        guard: dict[str, Any] = {
            k: cfg[k]
            for k in ("balance_abs_threshold", "balance_rel_threshold", "miss_spread")
            if k in cfg
        }
        clock = clock or time.monotonic
        self.approximate = ApproximateIndex(guard, clock=clock, rng=self._rng)
        self.pending = PendingBlocks(pending_seconds, clock)
        # The router's exact index, handed over in attach(); None: every worker falls back.
        self.kv_index: KvIndex | None = None
        self.fallbacks: Counter[str] = Counter()

    # -- sharing the approximate index between routers (routing.peers.fleet_sync) ----------------

    @property
    def outbox(self) -> list[tuple[int, list[int]]] | None:
        return self.approximate.outbox

    @outbox.setter
    def outbox(self, value: list[tuple[int, list[int]]] | None) -> None:
        self.approximate.outbox = value

    @property
    def shape(self) -> str:
        return self.approximate.shape

    def credit(self, worker_id: int, chain: list[int], shape: str) -> bool:
        return self.approximate.credit(worker_id, chain, shape)

    def attach(self, context: PolicyContext) -> None:
        self.kv_index = context.kv_index
        self._guard_abs = capped_guard(self.balance_abs_threshold, context.slots_per_worker)
        self.approximate.attach(context)

    # -- the decision ---------------------------------------------------------------------

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Choice:
        if not workers:
            return Choice(None, NO_WORKER)
        reason = self._fallback_reason(workers, request)
        if reason is not None:
            return self._approximate_select(workers, request, loads, reason)
        rows, hashes, chains = self._score(workers, request, loads)
        if hashes is not None:  # someone was scored approximately
            self.fallbacks["unknown_index"] += 1
        if self.pending.seconds > 0 and any(r.exact and not r.sized for r in rows):
            self.fallbacks["block_size_unknown"] += 1  # not credited: see "Block sizes"
        decision, best = self._decide(rows, request)
        if not best.exact and hashes is not None:
            self.approximate.credit_chain(best.worker.id, hashes)
        elif best.worker.id in chains:
            self.pending.credit(best.worker.id, chains[best.worker.id], request)
        return Choice(best.worker, decision, self._decided(decision, request, best))

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None:
        self.pending.confirm(request)

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        self.pending.end(request)

    def _fallback_reason(self, workers: Sequence[WorkerView], request: RequestInfo) -> str | None:
        return "no_tokens" if request.tokens is None else None

    def _approximate_select(
        self,
        workers: Sequence[WorkerView],
        request: RequestInfo,
        loads: Mapping[int, int],
        reason: str,
    ) -> Choice:
        """prefix_aware's whole rule, on the approximate index."""
        self.fallbacks[reason] += 1
        chosen = self.approximate.select(workers, request, loads)
        self.decisions["fallback"] += 1
        return Choice(chosen.worker, "fallback", chosen.prediction)

    def _score(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> tuple[list[_Scored], list[int] | None, dict[int, LazyChain]]:
        """Every worker's cached prompt tokens (exact where its index knows, with this
        router's pending credits on it) and cost; the prompt's approximate chain if any
        worker needed it; and, per exact worker, the prompt's chain past what it holds (for
        the pending credit)."""
        tokens = request.tokens or ()
        n = len(tokens)
        index = self.kv_index
        lora: LoraKey = request.model if _is_lora(workers[0], request.model) else None
        # One walk of the prompt's chain for every trusted worker (the untrusted are absent).
        next_keys: dict[int, int] = {}
        found: dict[int, tuple[int, int | None]] = {} if index is None else (
            index.cached_blocks_all([w.id for w in workers], tokens, lora, None, next_keys)
        )  # fmt: skip
        sizes = {w.id: found.get(w.id, (0, None))[1] or w.kv_block_size for w in workers}
        chains = self._chains_past_held(found, sizes, tokens, lora, next_keys)
        pending = self.pending.depths(chains, request) if chains else {}
        hashes: list[int] | None = None
        per_token = self.overlap_weight / self.block_size  # the cost of one prompt token
        rows = []
        for worker in workers:
            exact = found[worker.id][0] if worker.id in found else None
            size = sizes[worker.id] or self.block_size  # unknown: the worker holds nothing
            if exact is None:
                if hashes is None:
                    hashes = self.approximate.chain(request)
                cached = self.approximate.held_share(worker.id, hashes) * n
            else:
                cached = exact * size
            credited = pending.get(worker.id, 0) * size
            load = loads.get(worker.id, 0)
            row = _Scored(worker, cached + credited, size, exact is not None, load, 0.0)
            row.pending = credited > 0
            row.sized = sizes[worker.id] is not None
            row.cost = per_token * (n - row.cached) + self.load_weight * load
            rows.append(row)
        return rows, hashes, chains

    def _chains_past_held(
        self,
        found: Mapping[int, tuple[int, int | None]],
        sizes: Mapping[int, int | None],
        tokens: Sequence[int],
        lora: LoraKey,
        next_keys: Mapping[int, int],
    ) -> dict[int, LazyChain]:
        """Per exactly indexed worker, the prompt's chain in its own block size from the
        first block its events do not show, up to the credit's limit (hashed lazily)."""
        if self.pending.seconds <= 0:
            return {}
        chains: dict[int, LazyChain] = {}
        for worker_id, (held, _) in found.items():
            size = sizes.get(worker_id)
            if size is None:  # counted by select (explain counts nothing)
                continue
            upto = min(len(tokens) // size, self.pending.max_request_blocks)
            if held >= upto:
                continue
            key = next_keys.get(worker_id)
            if key is None:  # nothing stored yet: the walk did not ask it
                if held:
                    continue
                key = hash((chain_seed(lora), tuple(tokens[:size])))
            chains[worker_id] = LazyChain(tokens, size, held, key, upto)
        return chains

    def _decide(self, rows: list[_Scored], request: RequestInfo) -> tuple[str, _Scored]:
        """The cheapest row (ties: least loaded, then random), after the load guard; a miss
        by routing.policies.agreed_miss when ``miss_spread`` is set."""
        low_cost = min(row.cost for row in rows)
        cheapest = [row for row in rows if row.cost == low_cost]
        best = self._least_loaded(cheapest)
        low_load = min(row.load for row in rows)
        guard = best.load - low_load > self._guard_abs
        if guard and best.load > self.balance_rel_threshold * low_load:
            return "load", self._least_loaded([row for row in rows if row.load == low_load])
        if not any(row.cached >= row.size for row in rows):
            if self.miss_spread:
                key = self._miss_key(request.tokens or ())
                loads, ids = [row.load for row in rows], [row.worker.id for row in rows]
                best = rows[agreed_position(loads, ids, key, self.miss_spread)]
            return "miss", best
        if not best.exact:
            return "fallback", best
        return ("pending" if best.pending else "kv"), best

    def _miss_key(self, tokens: Sequence[int]) -> int:
        """The block at the middle of the prompt: users of one long system prompt share it,
        prompts that share only a short preamble do not (agreed_miss's key)."""
        size = self.block_size
        start = len(tokens) // 2 // size * size
        return hash(tuple(tokens[start : start + size]))

    def _least_loaded(self, rows: list[_Scored]) -> _Scored:
        low = min(row.load for row in rows)
        tied = [row for row in rows if row.load == low]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _decided(self, decision: str, request: RequestInfo, best: _Scored) -> Prediction:
        self.decisions[decision] += 1
        n, size = len(request.tokens or ()), best.size
        # Whole blocks, and never the prompt's last token: vLLM always computes that one.
        tokens = min(int(best.cached) // size, max(n - 1, 0) // size) * size
        share = tokens / n if n else 0.0
        return Prediction(request, best.worker.id, tokens, share, size)

    # -- explaining, read-only -----------------------------------------------------------

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """Each worker's cached and prompt tokens, where the number came from (events or the
        approximate index), load and cost, cheapest first; and the rule applied to them,
        crediting and counting nothing."""
        if not workers:
            return Explanation("no_worker", None, [])
        reason = self._fallback_reason(workers, request)
        if reason is not None:
            told = self.approximate.explain(workers, request, loads)
            rows = [{**row, "fallback": reason} for row in told.candidates]
            return Explanation("fallback", told.worker, rows)
        scored, _, _ = self._score(workers, request, loads)
        decision, best = self._decide(scored, request)
        scored.sort(key=lambda r: (r.cost, r.load))
        n = len(request.tokens or ())
        shown = [
            {"worker": r.worker.name, "cached_tokens": int(r.cached), "prompt_tokens": n,
             "block_size": r.size, "source": _source(r),
             "load": r.load, "cost": round(r.cost, 2)}
            for r in scored
        ]  # fmt: skip
        return Explanation(decision, best.worker, shown)


def _source(row: _Scored) -> str:
    if not row.exact:
        return "approximate"
    return "pending" if row.pending else "events"


def _is_lora(worker: WorkerView, model: str) -> bool:
    """True when `model` is a LoRA adapter on the worker (its entry names a parent)."""
    return any(entry.id == model and entry.parent for entry in worker.models)
