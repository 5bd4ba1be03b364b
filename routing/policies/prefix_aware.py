"""Prefix aware: send a prompt where its prefix is probably still in the KV cache.

vLLM skips the prefill of every leading block of a prompt that is still in the worker's
prefix cache, so a request that shares a long prefix with an earlier one (the next turn of a
chat, the same system prompt or document) is much cheaper on the worker that served the
earlier one. The router cannot see the workers' caches; like SGLang's `cache_aware` policy
it keeps an approximate picture of them: for each worker, the prompts recently sent there.

The rule (SGLang's `cache_aware`, per request, among the routable workers given)
------------------------------------------------------------------------------------
1. Load is in-flight requests on this router plus the worker's reported queue length, as
   in shortest_queue. If the load is imbalanced, i.e. ``max_load - min_load >
   balance_abs_threshold`` *and* ``max_load > balance_rel_threshold * min_load``, take the
   least loaded worker: decision ``"load"``. (A hot prefix keeps a worker busy; past the
   thresholds, spreading it beats the cache hit.)
2. Otherwise find the worker whose recent prompts share the longest prefix with this one.
   If the match covers at least ``cache_threshold`` of the prompt, take that worker (the
   least loaded one if several match as far): decision ``"prefix"``.
3. Otherwise take the worker with the smallest tree (the fewest remembered prompt chunks,
   so probably the most free cache; a new worker starts empty and so warms up first), the
   least loaded among equals: decision ``"smallest_tree"``, a reason of its own so
   /metrics tells cache misses from load balancing.

Ties left after those keys are broken at random. A request with no prompt text goes to the
least loaded worker (``"load"``). Whatever the reason, the chosen worker is then credited
with the prompt (in `select`, so the next request already sees it), as SGLang does; that
is what a worker's cache will hold once it has prefilled the prompt. The differences from
SGLang: the match must reach ``>= cache_threshold`` (SGLang: strictly greater), only the
workers given are considered (a worker that left the list is never chosen; its entries
simply age out), and matching is by chunks rather than per character.

How prompts are remembered
--------------------------
The prompt text (routing.request_text; computed here from the body if the proxy did not
pass it) is cut into chunks at fixed offsets: ``chunk_chars`` characters each for the first
``chunk_doubling`` chunks, then twice as long for the next ``chunk_doubling``, and so on.
Chunk *i* gets a chained hash identifying the whole prefix up to its end: the running sum
of ``hash((i, chunk_i))`` (siphash of the text, so equal sums for different prefixes are
2**-64 unlikely), like vLLM's block hashes chain each block to its parent. A worker's
"tree" is an OrderedDict from chained hash to the time it was last sent there, in
least-recently-used order. Inserting a prompt touches its chunks deepest first, so a
prefix is always at least as recent as anything that extends it; eviction takes the oldest
first, so a worker never keeps a chunk without the chunks before it. The prefixes a worker
holds are therefore closed under "shorter", and the longest match is found by *binary
search* over the prompt's chunks: O(log chunks) probes, each one dictionary lookup per
worker still in the running (every candidate for the first probe, then only the ones that
matched). Inserting is O(chunks) but done by C-level bulk calls (update, move_to_end).

Each memory entry is one (worker, chunk) pair: about 150 bytes (the OrderedDict slot and
its linked-list node, the chain-hash int; the timestamp float is shared by all the chunks
of one insert), so the default ``max_entries`` of 100,000 bounds the policy at about 15 MB
per model, plus the dicts' spare capacity (up to twice that just after they grow).

Knobs (the served model's policy_config; an unknown key or a bad value is a ValueError)
---------------------------------------------------------------------------------------
``cache_threshold`` (float in [0, 1], default 0.5)
    The share of the prompt (in characters, at chunk granularity) the best match must cover
    to route by prefix. 0 routes by prefix whenever at least one chunk matches; 1 only
    when the whole prompt matches.
``balance_abs_threshold`` (number >= 0, default 32)
    Load imbalance in requests (``max_load - min_load``) that must be *exceeded*, together
    with the relative one, to route by load instead of by cache.
``balance_rel_threshold`` (number >= 1, default 1.1)
    ``max_load`` must also exceed this multiple of ``min_load``.
``chunk_chars`` (int in [8, 65536], default 128)
    Characters per chunk, the matching granularity. A vLLM prefix-cache block is 16 tokens,
    about 64-80 characters of English, so 128 is about two blocks: matching to the
    character (SGLang's radix tree) buys nothing the 50% threshold would notice, while
    every chunk costs one string slice, one hash and one dictionary slot in Python.
``chunk_doubling`` (int >= 0, default 32)
    After this many chunks the chunk length doubles (and again after as many more): with
    the defaults the first 4,096 characters (about 1k tokens) are matched per 128, the next
    8,192 per 256, then per 512... A 4k-word prompt (about 25k characters) is ~90 chunks
    instead of ~200, which halves the per-request cost, while a match length is still
    known to within 1/32 (3%) of itself. 0 keeps every chunk ``chunk_chars`` long.
``max_entries`` (int >= 1, default 100000)
    Total (worker, chunk) entries over all workers. Past it, the least recently used
    entries of the largest tree are evicted (the worker whose own cache has most likely
    dropped them already), at once, as part of the insert that overflowed: never more
    than that insert added.
``max_age_s`` (number > 0, default 600)
    An entry not touched for this long is ignored by matching and evicted: every decision
    sweeps the stale head of one worker's tree (round robin over the trees, at most
    32 + the request's chunk count entries), so memory is given back incrementally and
    the trees of workers that left the list drain and are dropped. Set it near the time
    the workers' caches keep an idle prefix.

Not thread-safe: one router process decides on one event loop. No I/O. `insert()` pre-fills
a tree (benchmarks, tests); `match()` and `tree_size()` inspect it.
"""

from __future__ import annotations

import math
import random
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import accumulate, compress, count, islice, repeat, takewhile
from operator import ge, gt
from typing import Any

from routing.policies.base import BasePolicy, RequestInfo
from routing.request_text import request_text
from routing.snapshot import WorkerView

_Tree = OrderedDict[int, float]  # chained chunk hash -> last access (clock seconds)

_DEFAULTS: dict[str, float] = {
    "cache_threshold": 0.5,
    "balance_abs_threshold": 32,
    "balance_rel_threshold": 1.1,
    "chunk_chars": 128,
    "chunk_doubling": 32,
    "max_entries": 100_000,
    "max_age_s": 600.0,
}
_SWEEP_BASE = 32  # entries a decision may sweep beyond its own chunk count
_NEVER = -math.inf
_EMPTY: _Tree = OrderedDict()  # stands in for a worker with no tree; never written


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


class PrefixAwarePolicy(BasePolicy):
    name = "prefix_aware"
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
        self.balance_rel_threshold = float(_setting(cfg, "balance_rel_threshold", low=1.0))
        self.chunk_chars = int(_setting(cfg, "chunk_chars", integer=True, low=8, high=65536))
        self.chunk_doubling = int(_setting(cfg, "chunk_doubling", integer=True, low=0))
        self.max_entries = int(_setting(cfg, "max_entries", integer=True, low=1))
        self.max_age_s = float(_setting(cfg, "max_age_s", low=0.0, low_open=True))
        self._clock = clock or time.monotonic
        self._rng = rng or random.Random()
        self._trees: dict[int, _Tree] = {}  # worker id -> its tree
        self._entries = 0  # sum of the trees' sizes
        self._sweep_queue: list[int] = []  # worker ids still to sweep in this round
        # Chunk i spans _starts[i] up to _ends[i], sliced by _slices[i]; grown on demand.
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._slices: list[slice] = []

    # -- the decision ---------------------------------------------------------------------

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, inflight: Mapping[int, int]
    ) -> WorkerView | None:
        if not workers:
            return None
        now = float(self._clock())
        text = request.text if request.text is not None else request_text(request.body)
        loads = [inflight.get(w.id, 0) + (w.queue_length or 0) for w in workers]
        low, high = min(loads), max(loads)
        hashes = self._chain(text)
        if not hashes or (
            high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low
        ):
            reason, chosen = "load", self._least_loaded(workers, loads)
        else:
            ids = [w.id for w in workers]
            depth, holders = self._match(hashes, ids, now - self.max_age_s)
            matched = min(self._ends[depth - 1], len(text)) if depth else 0
            if depth and matched >= self.cache_threshold * len(text):
                reason = "prefix"
                held = set(holders)
                pairs = [(w, x) for w, x in zip(workers, loads, strict=True) if w.id in held]
                chosen = self._least_loaded([w for w, _ in pairs], [x for _, x in pairs])
            else:
                reason, chosen = "smallest_tree", self._smallest_tree(workers, loads)
        self.decisions[reason] += 1
        if hashes:
            self._insert(chosen.id, hashes, now)
        self._sweep(now, _SWEEP_BASE + len(hashes))
        return chosen

    def _least_loaded(self, workers: Sequence[WorkerView], loads: Sequence[int]) -> WorkerView:
        low = min(loads)
        best = [w for w, load in zip(workers, loads, strict=True) if load == low]
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def _smallest_tree(self, workers: Sequence[WorkerView], loads: Sequence[int]) -> WorkerView:
        trees = self._trees
        keys = [
            (len(trees.get(w.id, _EMPTY)), load) for w, load in zip(workers, loads, strict=True)
        ]
        low = min(keys)
        best = [w for w, key in zip(workers, keys, strict=True) if key == low]
        return best[0] if len(best) == 1 else self._rng.choice(best)

    # -- the trees ------------------------------------------------------------------------

    def _chain(self, text: str) -> list[int]:
        """The chained hash of every chunk of `text`, in order (the last one may be short)."""
        n = len(text)
        if not n:
            return []
        if not self._ends or self._ends[-1] < n:
            self._grow_chunks(n)
        m = bisect_left(self._starts, n)  # chunks that start inside the text
        pieces = map(text.__getitem__, self._slices[:m])
        return list(accumulate(map(hash, zip(count(), pieces))))

    def _grow_chunks(self, n: int) -> None:
        starts, ends, slices = self._starts, self._ends, self._slices
        pos = ends[-1] if ends else 0
        while pos < n:
            i = len(starts)
            size = self.chunk_chars << (i // self.chunk_doubling if self.chunk_doubling else 0)
            starts.append(pos)
            ends.append(pos + size)
            slices.append(slice(pos, pos + size))
            pos += size

    def _match(self, hashes: list[int], ids: list[int], cutoff: float) -> tuple[int, list[int]]:
        """(chunks matched, ids of the workers that hold that many) over workers `ids`.

        A worker's chunks are prefix-closed (see the module docstring), so whether it holds
        the first d chunks is monotone in d and a binary search finds the longest match.
        """
        trees = list(map(self._trees.get, ids, repeat(_EMPTY)))
        alive = self._holding(hashes[0], ids, trees, cutoff)
        if alive is None:
            return 0, []
        ids, trees = alive
        lo, hi = 1, len(hashes)  # the first lo chunks are held by every worker in `ids`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            key = hashes[mid - 1]
            if len(trees) == 1:  # the usual case: a prefix lives on one worker
                if trees[0].get(key, _NEVER) >= cutoff:
                    lo = mid
                else:
                    hi = mid - 1
                continue
            alive = self._holding(key, ids, trees, cutoff)
            if alive is None:
                hi = mid - 1
            else:
                lo = mid
                ids, trees = alive
        return lo, ids

    @staticmethod
    def _holding(
        key: int, ids: list[int], trees: list[_Tree], cutoff: float
    ) -> tuple[list[int], list[_Tree]] | None:
        """The workers among `ids` whose tree holds `key` fresh, or None."""
        fresh = list(
            map(ge, map(OrderedDict.get, trees, repeat(key), repeat(_NEVER)), repeat(cutoff))
        )
        if not any(fresh):
            return None
        return list(compress(ids, fresh)), list(compress(trees, fresh))

    def _insert(self, worker_id: int, hashes: list[int], now: float) -> None:
        tree = self._trees.get(worker_id)
        if tree is None:
            tree = self._trees[worker_id] = OrderedDict()
        before = len(tree)
        # Deepest first, so every prefix ends up more recent than what extends it.
        tree.update(zip(reversed(hashes), repeat(now)))
        deque(map(tree.move_to_end, reversed(hashes)), maxlen=0)
        self._entries += len(tree) - before
        excess = self._entries - self.max_entries
        while excess > 0:
            largest = max(self._trees.values(), key=len)
            k = min(excess, len(largest))
            if not k:  # cannot happen while _entries is right; never spin
                break
            deque(map(largest.popitem, repeat(False, k)), maxlen=0)
            self._entries -= k
            excess -= k

    def _sweep(self, now: float, budget: int) -> None:
        """Evict the stale head of one tree (round robin); drop the tree once empty."""
        if not self._sweep_queue:
            if not self._trees:
                return
            self._sweep_queue = list(self._trees)
        worker_id = self._sweep_queue.pop()
        tree = self._trees.get(worker_id)
        if tree is None:
            return
        stale_before = partial(gt, now - self.max_age_s)  # t -> t < cutoff
        k = len(list(takewhile(stale_before, islice(tree.values(), budget))))
        if k:
            deque(map(tree.popitem, repeat(False, k)), maxlen=0)
            self._entries -= k
        if not tree:
            del self._trees[worker_id]

    # -- for benchmarks, tests and the curious --------------------------------------------

    def insert(self, worker_id: int, text: str) -> None:
        """Credit `worker_id` with `text`, as if it had just been routed there."""
        hashes = self._chain(text)
        if hashes:
            self._insert(worker_id, hashes, float(self._clock()))

    def match(self, text: str, worker_ids: Sequence[int]) -> tuple[int, list[int]]:
        """(characters matched, the workers among `worker_ids` that hold that prefix)."""
        hashes = self._chain(text)
        if not hashes:
            return 0, []
        cutoff = float(self._clock()) - self.max_age_s
        depth, holders = self._match(hashes, list(worker_ids), cutoff)
        return (min(self._ends[depth - 1], len(text)) if depth else 0), holders

    def tree_size(self, worker_id: int) -> int:
        """Entries (chunks) remembered for a worker, stale ones not yet swept included."""
        return len(self._trees.get(worker_id, _EMPTY))

    @property
    def entries(self) -> int:
        """Entries over all workers; never more than max_entries after a decision."""
        return self._entries
