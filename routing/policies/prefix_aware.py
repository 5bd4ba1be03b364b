"""Prefix aware: send a prompt where its prefix is probably still in the KV cache.

vLLM skips the prefill of every leading block of a prompt that is still in the worker's
prefix cache, so a request that shares a long prefix with an earlier one (the next turn of a
chat, the same system prompt or document) is much cheaper on the worker that served the
earlier one. The router cannot see the workers' caches; like SGLang's `cache_aware` policy
it keeps an approximate picture of them: for each worker, the prompts recently sent there.

The rule (SGLang's `cache_aware`, with a per-worker load guard; among the workers given)
--------------------------------------------------------------------------------------
Load is routing.policies.load's fused signal, as in shortest_queue: the same in every router.

1. Find the worker whose recent prompts share the longest prefix with this one. If the
   match covers at least ``cache_threshold`` of the prompt, the candidate is that worker
   (the least loaded one if several match as far): decision ``"prefix"``.
2. Otherwise it is a cache miss wherever it goes: take the least loaded worker, and among
   equally loaded ones the one with the smallest tree (the fewest remembered prompt chunks,
   so probably the most free cache; a new worker starts empty and so warms up first):
   decision ``"miss"``, a reason of its own so /metrics tells cache misses from load
   balancing. (SGLang takes the smallest tree first; with nothing cached to win, the queue
   is all that this request's latency depends on, so load comes first here.)
3. The load guard (rule 1's candidate): if the candidate is overloaded, i.e. ``load - min_load >
   balance_abs_threshold`` *and* ``load > balance_rel_threshold * min_load`` (``min_load``
   over all the workers given), take the least loaded worker instead: decision ``"load"``.
   A hot prefix (one system prompt carrying half the traffic) would otherwise queue on one
   worker; past the thresholds a queue costs more than re-reading the prefix elsewhere,
   and once the least loaded worker has taken such a request it holds the prefix too, so
   the next ones split between the holders by load (rule 1) with no further misses.

SGLang checks the imbalance over the whole fleet (``max_load`` instead of the candidate's
load) and then routes *every* request by load, so one hot worker also sends away requests
whose own worker is idle, each a cache miss; the guard here moves only the requests that
would join the overloaded worker. The thresholds are in requests, so they depend on how
many requests a worker runs at once (its batch): past it, requests queue at the worker.

Ties left after those keys are broken at random. A request with no prompt text goes to the
least loaded worker (``"load"``). Whatever the reason, the chosen worker is then credited
with the prompt (in `select`, so the very next request already sees it), as SGLang does:
that is what the worker's cache will hold once it has prefilled the prompt. Differences
from SGLang: the match must reach ``>= cache_threshold`` (SGLang: strictly greater), only
the workers given are considered (a worker that left the list is never chosen, and its
entries age out), and prompts are matched by chunks rather than character by character.

How prompts are remembered
--------------------------
The prompt text (routing.policies.request_text; computed here from the body if the proxy did not
pass it) is cut into chunks of ``chunk_chars`` bytes, longer after every ``chunk_doubling``
of them, each named by a chained hash of the whole prefix up to its end, the same in every
process (routing.policies.prompt_chunks).

Each worker's prompts are kept in a "tree" (routing.policies.prefix_trees: what it holds of
any prompt is always a prefix of that prompt's chain, its entries age out by time marks, and
memory is bounded by ``max_entries``). So a worker's match is found by a *binary search*
over the prompt's chunks (O(log chunks) lookups), and the fleet's longest match without
looking at every worker: an index from first-chunk hash to the workers holding it names the
workers in the running; the search runs on one of them, then one lookup per other such
worker asks whether anyone holds the next chunk (if so, the search goes on among those). Ids
and queue lengths are cached per snapshot tuple.

Loads, and what is exact from which fleet size
----------------------------------------------
Below 128 workers (routing.policies.load_index.INDEX_MIN_WORKERS), and for the first
decision over a worker tuple not seen before, a decision reads every worker's load (one
C-level pass) and, on a miss, the tree size of every worker tied at the least load: the
rules above hold exactly. From 128 workers on, the second and later decisions over the same
tuple (the router passes its snapshot's until the next swap) ask a `LoadIndex`, a lazy
min-heap of loads rebuilt per tuple and every 256 decisions, for the least load (the guard's
``min_load``) and the least loaded worker (a spill, a prompt without text), and read the
loads of the longest match's holders only: O(log n) per decision instead of O(n). Those
answers are exact while only this policy's requests change the in-flight counts of its
workers; a worker that another model's requests load too is seen at once when its load
rose, and within 256 decisions when it fell (see that module). One rule is approximate
there: a miss goes to the smallest tree among up to 8 of the workers tied at the least load
(a random sample of them), not among all of them.

Knobs (the served model's policy_config; an unknown key or a bad value is a ValueError)
---------------------------------------------------------------------------------------
``cache_threshold`` (float in [0, 1], default 0.5)
    The share of the prompt (in characters, at chunk granularity) the best match must cover
    to route by prefix. 0 routes by prefix whenever at least one chunk matches; 1 only
    when the whole prompt matches.
``balance_abs_threshold`` (number >= 0, default 32)
    How many requests more than the least loaded worker the candidate must *exceed*,
    together with the relative threshold, for the request to go by load instead. The
    default is SGLang's, for GPU workers that run dozens to hundreds of sequences at once;
    with smaller batches set it lower, to about one batch of the workers (e.g. 8 for
    workers that run 8 at once, as in bench/routing/run.py): 32 then never triggers
    and a hot prefix queues on one worker. Lower spills sooner, which pays when a cache
    miss is cheap (short prompts, fast prefill); with long shared prefixes every spill is
    a full prefill, so wait for a real queue (bench/RESULTS.md compares 4, 8 and 32).
    0 with a relative threshold of 1 is plain shortest-queue whenever loads differ.
``balance_rel_threshold`` (number >= 1, default 1.1)
    The candidate's load must also exceed this multiple of the least loaded worker's, so
    that at high load a difference of a few requests does not cost a cache miss.
``chunk_chars`` (int in [8, 65536], default 128)
    Characters per chunk, the matching granularity. A vLLM prefix-cache block is 16 tokens,
    about 64-80 characters of English, so 128 is about two blocks: matching to the
    character (SGLang's radix tree) buys nothing the 50% threshold would notice, while
    every chunk costs a string slice, a hash and a dictionary operation in Python.
``chunk_doubling`` (int >= 0, default 8)
    After this many chunks the chunk length doubles, and again after as many more: with the
    defaults the first 1,024 characters (about 250 tokens) are matched per 128, the next
    2,048 per 256, the next 4,096 per 512, then 8,192 per 1,024, then per 2,048... A
    4k-word prompt (about 26k characters) is 38 chunks instead of 207, which divides the
    per-request cost by about three (every chunk is a string slice, a hash and a dictionary
    operation in Python), while a match length stays known to within 1/8 of itself: ample
    for a 50% threshold, and where a long chat's turns differ (its tail) the next turn still
    matches all but its last few hundred tokens. 16 halves that error for about 20% more
    time; 0 keeps every chunk ``chunk_chars`` long (the cost then grows linearly).
``max_entries`` (int >= 1, default 100000)
    Total (worker, chunk) entries over all workers. When crediting a prompt goes past it,
    the tree it went to gives back its least recently used entries beyond its fair share
    (max_entries / number of trees), then, if that is not enough, the largest tree gives
    back its least recently used ones (the worker whose own cache has most likely dropped
    them already). Never more than the prompt added, so no request pays for a big sweep.
    Eviction is least-recently-used per tree, not across trees: one global order would
    cost another ordered structure per entry, and fair shares keep the trees level, which
    is what smallest-tree routing assumes anyway.
``max_age_s`` (number > 0, default 600)
    Entries not used for this long are evicted: every decision sweeps the stale head of
    the tree it credited and of one other tree in turn (round robin), at most 32 + the
    request's chunk count items each, so memory comes back incrementally, a busy tree's
    stale part never grows faster than it is swept, and the trees of idle workers and of
    workers that left the list drain and are dropped. Set it near how long the workers'
    caches keep an idle prefix.
``miss_spread`` (number >= 0, default 0)
    With several routers: a miss goes to the worker the prompt ranks first by rendezvous
    hashing among those within this many requests of the least loaded (rule 2 then no
    longer looks at trees; routing.policies.agreed_miss), so routers that see the same new
    prefix at the same moment, before either hears of the other's credit, put it on one
    worker instead of prefilling it twice. 0 keeps rule 2 as written. It is a trade, so it
    is off by default (bench/RESULTS.md, 2026-12-02 evening): at 2, two replicas on
    ``prefix`` went from 1.26-1.31x the client oracle's mean TTFT to 1.16-1.19x, but one
    router on ``uniform`` (every request a miss) queued more (p99 1.17x shortest_queue's
    instead of 0.99x); at 8 the hash outweighs the load and the load guard spills.

Sharing between routers
-----------------------
With several routers (routing.peers.fleet_sync), each decision's (worker, chain) is also put in
`outbox` when the router set one, and the router publishes them in batches; every other
router credits them with `credit()`, as if it had routed the prompt itself, so all build the
same picture of the workers' caches. `shape` names the chunking, and a credit made with
another shape (a config change reaching routers a moment apart) is ignored.

Not thread-safe: one router process decides on one event loop. No I/O. `insert()` credits
a prompt to a worker (benchmarks, tests); `match()`, `tree_size()` and `entries` inspect.
`on_request_complete` keeps the credit even for a failed request (SGLang does too): the
worker may well have prefilled it, and a failing worker leaves the routable list anyway.
"""

from __future__ import annotations

import math
import random
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, count, repeat
from operator import attrgetter, eq
from typing import Any

from routing.fleet.snapshot import WorkerView
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
from routing.policies.load_index import LoadIndex
from routing.policies.prefix_trees import PrefixTrees, held_depth
from routing.policies.prompt_chunks import PromptChunks
from routing.policies.request_text import request_text

_DEFAULTS: dict[str, float] = {
    "cache_threshold": 0.5,
    "balance_abs_threshold": 32,
    "balance_rel_threshold": 1.1,
    "chunk_chars": 128,
    "chunk_doubling": 8,
    "max_entries": 100_000,
    "max_age_s": 600.0,
    "miss_spread": 0,
}
_SWEEP_BASE = 32  # entries a decision may sweep beyond its own chunk count
_ID = attrgetter("id")


def _setting(
    config: Mapping[str, Any],
    key: str,
    *,
    integer: bool = False,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
) -> float:
    value = config.get(key, _DEFAULTS[key])
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"prefix_aware: {key} must be {kind}, not {value!r}")
    if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
        bound = f"> {low}" if low_open else f">= {low}"
        limit = f" and <= {high}" if high != math.inf else ""
        raise ValueError(f"prefix_aware: {key} must be {bound}{limit}, not {value!r}")
    return value


class PrefixAwarePolicy(PromptChunks, PrefixTrees, BasePolicy):
    name = "prefix_aware"
    shares = True
    needs_request_text = True

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(config)
        unknown = sorted(set(self.config) - set(_DEFAULTS))
        if unknown:
            known = ", ".join(sorted(_DEFAULTS))
            raise ValueError(f"prefix_aware: unknown setting(s) {unknown}; known: {known}")
        cfg = self.config
        self.cache_threshold = float(_setting(cfg, "cache_threshold", low=0.0, high=1.0))
        self.balance_abs_threshold = float(_setting(cfg, "balance_abs_threshold", low=0.0))
        self._guard_abs = self.balance_abs_threshold  # under the model's cap (attach)
        self.balance_rel_threshold = float(_setting(cfg, "balance_rel_threshold", low=1.0))
        chunk_chars = int(_setting(cfg, "chunk_chars", integer=True, low=8, high=65536))
        self._init_chunks(chunk_chars, int(_setting(cfg, "chunk_doubling", integer=True, low=0)))
        self.max_entries = int(_setting(cfg, "max_entries", integer=True, low=1))
        self.max_age_s = float(_setting(cfg, "max_age_s", low=0.0, low_open=True))
        self.miss_spread = float(_setting(cfg, "miss_spread", low=0.0))
        self._clock = clock or time.monotonic
        self._rng = rng or random.Random()
        self._init_trees(self.max_entries, self.max_age_s)
        self._sweep_queue: list[int] = []  # worker ids still to sweep in this round
        # The last worker tuple seen (the router passes its snapshot's until the next swap),
        # with its ids and id -> position: per-snapshot work done once.
        self._fleet: Sequence[WorkerView] | None = None
        self._fleet_ids: list[int] = []
        self._fleet_pos: dict[int, int] = {}
        # (worker id, chain) of each decision, for other routers (routing.peers.fleet_sync);
        # None: nobody listens, nothing is kept.
        self.outbox: list[tuple[int, list[int]]] | None = None
        self._shape = f"{self.chunk_chars}/{self.chunk_doubling}"
        self._index = LoadIndex(self._rng)  # the least loaded, from 128 workers

    # -- the decision ---------------------------------------------------------------------

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Choice:
        if not workers:
            return Choice(None, NO_WORKER)
        now = float(self._clock())
        text = request.text if request.text is not None else request_text(request.body)
        ids, pos = self._fleet_of(workers)
        # Below 128 workers every load, once; from 128 on (the tuple's second decision on)
        # the index answers for the least loaded, and only candidates' scanned are read.
        index = self._index if self._index.use(workers, loads) else None
        scanned = None
        if index is None:
            scanned = list(map(loads.get, ids, repeat(0)))
        hashes = self._chain(text)
        held: int | None = None  # chunks of this prompt the chosen worker holds, if known
        if not hashes:
            reason, at = "load", self._lightest(scanned, loads)
        else:
            depth, holders, trees = self._match(hashes, pos)
            length = self._chained_bytes
            matched = min(self._ends[depth - 1], length) if depth else 0
            if depth and matched >= self.cache_threshold * length:
                reason, held = "prefix", depth
                if len(holders) > 1:
                    holders = self._holding(hashes[depth - 1], holders, trees)[0]
                at = pos[holders[0]]
                if len(holders) > 1:
                    spots = [pos[h] for h in holders]
                    at = spots[self._least([loads.get(ids[i], 0) for i in spots])]
                low = min(scanned) if scanned is not None else self._index.min_load(loads)
                if self._overloaded(loads.get(ids[at], 0), low):
                    reason, held, at = "load", None, self._lightest(scanned, loads)
            elif scanned is not None and self.miss_spread:
                key = hashes[
                    min(bisect_left(self._ends, self.cache_threshold * length), len(hashes) - 1)
                ]
                reason, at = "miss", agreed_position(scanned, ids, key, self.miss_spread)
            elif scanned is not None:
                reason, at = "miss", self._least(scanned, ids=ids)
            else:
                reason, at = "miss", self._smallest_tree(self._index.least_tied(loads, 8), ids)
        chosen = workers[at]
        self.decisions[reason] += 1
        prediction = None
        if index is not None:
            index.touch(chosen.id)
        budget = _SWEEP_BASE + len(hashes)
        if hashes:
            held, prediction = self._predict(request, chosen.id, hashes, held)
            self._insert(chosen.id, hashes, now, held)
            if self.outbox is not None:
                self.outbox.append((chosen.id, hashes))
            self._sweep(chosen.id, now, budget)  # its stale head cannot outgrow its inserts
        if not self._sweep_queue:  # and one tree in turn, so idle and departed ones drain
            self._sweep_queue = list(self._trees)
        if self._sweep_queue:
            self._sweep(self._sweep_queue.pop(), now, budget)
        return Choice(chosen, reason, prediction)

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        self._index.touch(worker.id)

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        self._index.touch(worker.id)

    def _fleet_of(self, workers: Sequence[WorkerView]) -> tuple[list[int], dict[int, int]]:
        """Ids and id -> position of `workers`; cached while the same tuple comes back (a
        tuple of frozen WorkerViews cannot change)."""
        if workers is self._fleet:
            return self._fleet_ids, self._fleet_pos
        ids = list(map(_ID, workers))
        pos = dict(zip(ids, count()))
        if isinstance(workers, tuple):  # holding it also keeps its id() from being reused
            self._fleet = workers
            self._fleet_ids, self._fleet_pos = ids, pos
        return ids, pos

    def _predict(
        self, request: RequestInfo, worker_id: int, hashes: list[int], held: int | None
    ) -> tuple[int, Prediction]:
        """The chunks of the prompt the chosen worker holds (so crediting need not look),
        and its share as the prediction routing.telemetry.cache_check checks."""
        if held is None:
            tree = self._trees.get(worker_id)
            held = held_depth(tree, hashes, 0) if tree is not None else 0
        matched = min(self._ends[held - 1], self._chained_bytes) if held else 0
        return held, Prediction(request, worker_id, None, matched / self._chained_bytes)

    def attach(self, context: PolicyContext) -> None:
        self._guard_abs = capped_guard(self.balance_abs_threshold, context.slots_per_worker)

    def _overloaded(self, load: int, low: int) -> bool:
        """The load guard: `load` is past both thresholds over the least loaded's `low`."""
        return load - low > self._guard_abs and load > self.balance_rel_threshold * low

    def _lightest(self, scanned: list[int] | None, loads: Mapping[int, int]) -> int:
        """The position of a least loaded worker: from `scanned`, or the index's (None)."""
        return self._least(scanned) if scanned is not None else self._index.least(loads)

    def _least(self, keys: list[int], *, ids: list[int] | None = None) -> int:
        """The index of the least of `keys` (loads); ties go to the smallest tree when the
        workers' `ids` are given, then at random."""
        low = min(keys)
        k = keys.index(low)
        if keys.count(low) > 1:
            ties = list(compress(count(), map(eq, keys, repeat(low))))
            k = self._smallest_tree(ties, ids) if ids is not None else self._rng.choice(ties)
        return k

    def _smallest_tree(self, spots: list[int], ids: list[int]) -> int:
        """Of the positions `spots`, the one whose worker's tree is smallest (random on a
        tie)."""
        trees = [self._sizes.get(ids[i], 0) for i in spots]
        smallest = min(trees)
        spots = list(compress(spots, map(eq, trees, repeat(smallest))))
        return spots[0] if len(spots) == 1 else self._rng.choice(spots)

    # -- matching -------------------------------------------------------------------------

    # -- explaining, read-only -----------------------------------------------------------

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """Each worker's matched prefix (bytes of this prompt its tree holds), load and tree
        size, best match first; and the rule above applied to them, crediting nothing."""
        text = request.text if request.text is not None else request_text(request.body)
        hashes = self._chain(text)
        length = self._chained_bytes
        rows = []
        for worker in workers:
            tree = self._trees.get(worker.id)
            depth = held_depth(tree, hashes, 0) if tree is not None and hashes else 0
            matched = min(self._ends[depth - 1], length) if depth else 0
            rows.append((matched, loads.get(worker.id, 0), worker))
        rows.sort(key=lambda r: (-r[0], r[1]))
        decision, chosen = self._would_choose(rows, length)
        shown = [
            {"worker": w.name, "matched_bytes": m, "prompt_bytes": length, "load": load,
             "tree_size": self._sizes.get(w.id, 0)}
            for m, load, w in rows
        ]  # fmt: skip
        return Explanation(decision, chosen, shown)

    def _would_choose(
        self, rows: list[tuple[int, int, WorkerView]], length: int
    ) -> tuple[str, WorkerView | None]:
        if not rows:
            return "load", None
        low = min(load for _, load, _ in rows)
        lightest = min(rows, key=lambda r: (r[1], self._sizes.get(r[2].id, 0)))[2]
        best = rows[0]
        if not length:
            return "load", lightest
        if not best[0] or best[0] < self.cache_threshold * length:
            return "miss", lightest
        if self._overloaded(best[1], low):
            return "load", lightest
        return "prefix", best[2]

    # -- for benchmarks, tests and the curious --------------------------------------------

    def insert(self, worker_id: int, text: str) -> None:
        """Credit `worker_id` with `text`, as if it had just been routed there."""
        hashes = self._chain(text)
        if hashes:
            self._insert(worker_id, hashes, float(self._clock()), None)

    def match(self, text: str, worker_ids: Sequence[int]) -> tuple[int, list[int]]:
        """(bytes matched (characters, for ASCII text), the workers among `worker_ids` that
        hold that prefix, in the order given). Read-only: it credits and refreshes nothing."""
        hashes = self._chain(text)
        if not hashes:
            return 0, []
        pos = dict(zip(worker_ids, count()))
        depth, holders, trees = self._match(hashes, pos)
        if not depth:
            return 0, []
        holders = self._holding(hashes[depth - 1], holders, trees)[0]
        holders.sort(key=pos.__getitem__)
        return min(self._ends[depth - 1], self._chained_bytes), holders

    @property
    def shape(self) -> str:
        return self._shape

    def credit(self, worker_id: int, chain: list[int], shape: str) -> bool:
        """Credit a prompt another router sent to `worker_id` (its chain, made with chunking
        `shape`), as if routed here; False when the shapes differ and nothing was done."""
        if shape != self.shape or not chain:
            return False
        self._insert(worker_id, chain, float(self._clock()), None)
        return True
