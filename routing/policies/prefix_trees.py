"""The prefix_aware policy's picture of each worker's prefix cache: one tree per worker.

A worker's "tree" is an OrderedDict of chained hashes in least-recently-used order.
Crediting a prompt appends its new chunks deepest first, then moves the chunks the worker
already held (a prefix of the prompt) to the end, also deepest first: one
C-level operation per chunk, and a prefix always ends up more recent than anything that
extends it. Eviction only ever takes the oldest, so a worker never keeps a chunk without
the chunks before it: what it holds of any prompt is a prefix of that prompt's chain.

Age is tracked by time marks in each tree rather than a timestamp per entry: crediting a
prompt ends by moving the tree's newest mark to the end (stamped now), or by adding a new
one once the newest is ``max_age_s / 32`` old. Everything before a mark was last used no
later than the mark's time, so once the oldest mark is older than ``max_age_s``, the entries
before it are stale. An entry is evicted between ``max_age_s`` and about ``max_age_s *
33/32`` after its last use, give or take the sweep's pace (prefix_aware's ``max_age_s``);
until then it still counts for matching (vLLM itself never drops a cached block for age,
only for room).

Memory: an entry is one (worker, chunk) pair, about 140-160 bytes measured with
tracemalloc (the OrderedDict slot and linked-list node, the chain-hash int, its share of
the first-chunk index), so the default ``max_entries`` of 100,000 bounds the policy near
16 MB per served model (a hash table that has just doubled adds up to half as much again
for a while). Marks are few: one per ``max_age_s / 32`` of use of a tree, dropped as
they go stale.

Matching a prompt's chain: an index from first-chunk hash to the trees holding it names the
workers in the running; a binary search finds one holder's depth, then one lookup per other
holder asks whether anyone holds the next chunk (if so, the search goes on among those).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping
from itertools import compress, count, islice, repeat
from operator import is_not
from typing import Any

# Chained chunk hash (int) -> None, or a time mark (Mark) -> when it was last moved.
Tree = OrderedDict[Hashable, float | None]
MARKS_PER_AGE = 32  # a new time mark once the newest is max_age_s / 32 old


class Mark:
    """A time mark in a tree; only its identity matters (the tree holds its time)."""

    __slots__ = ("created",)

    def __init__(self, created: float) -> None:
        self.created = created


class PrefixTrees:
    """Per worker: its tree, its time marks and its entry count, and the first-chunk index;
    crediting, eviction by room and by age. Mixed into PrefixAwarePolicy, whose knobs
    ``max_entries`` and ``max_age_s`` bound it."""

    max_entries: int
    max_age_s: float

    def _init_trees(self, max_entries: int, max_age_s: float) -> None:
        self._mark_every = max_age_s / MARKS_PER_AGE
        # Per worker id: its tree, its time marks (oldest first) and its entry count.
        self._trees: dict[int, Tree] = {}
        self._marks: dict[int, deque[Mark]] = {}
        self._sizes: dict[int, int] = {}
        self._entries = 0  # sum of _sizes
        # First-chunk hash -> {worker id: its tree} for the trees that hold it.
        self._heads: dict[int, dict[int, Tree]] = {}

    def _insert(self, worker_id: int, hashes: list[int], now: float, held: int | None) -> None:
        """Credit `worker_id` with the chain `hashes`, of which it holds the first `held`
        (None: look it up)."""
        tree = self._trees.get(worker_id)
        if tree is None:
            tree = self._trees[worker_id] = OrderedDict()
            self._marks[worker_id] = deque()
            self._sizes[worker_id] = 0
        if held is None:
            held = held_depth(tree, hashes, 0)
        added = len(hashes) - held
        if added:  # new chunks, deepest first, appended...
            fresh = hashes[held:]
            tree.update(zip(reversed(fresh), repeat(None)))
            if not held:
                self._heads.setdefault(hashes[0], {})[worker_id] = tree
            self._sizes[worker_id] += added
            self._entries += added
        if held:  # ...then the held prefix moved after them, deepest first
            deque(map(tree.move_to_end, reversed(hashes[:held])), maxlen=0)
        marks = self._marks[worker_id]
        if marks and now - marks[-1].created < self._mark_every:
            tree.move_to_end(marks[-1])
            tree[marks[-1]] = now
        else:
            mark = Mark(now)
            tree[mark] = now
            marks.append(mark)
        over = self._entries - self.max_entries
        if over > 0:
            self._shrink(worker_id, tree, over)

    def _shrink(self, worker_id: int, tree: Tree, over: int) -> None:
        """Evict `over` entries: first this tree's beyond its fair share, then the largest's."""
        sizes = self._sizes
        own = min(over, sizes[worker_id] - self.max_entries // len(self._trees))
        if own > 0:
            over -= self._pop_oldest(worker_id, tree, own, entries=True)
        while over > 0:
            largest = max(sizes, key=sizes.__getitem__)
            if not sizes[largest]:  # cannot happen while the counts are right; never spin
                break
            over -= self._pop_oldest(largest, self._trees[largest], over, entries=True)

    def _pop_oldest(self, worker_id: int, tree: Tree, n: int, *, entries: bool) -> int:
        """Evict from the old end of a tree: n items (marks included), or with `entries`
        n entries (or all it has). Returns the entries evicted."""
        marks = self._marks[worker_id]
        gone = 0
        while n > 0 and tree:
            items = list(map(tree.popitem, repeat(False, min(n, len(tree)))))
            keys = [key for key, value in items if value is None]
            for _ in range(len(items) - len(keys)):
                marks.popleft()  # marks leave in order
            if keys:
                self._forget(worker_id, keys)
            gone += len(keys)
            n -= len(keys) if entries else len(items)
        self._sizes[worker_id] -= gone
        self._entries -= gone
        return gone

    def _forget(self, worker_id: int, keys: list[Any]) -> None:
        """Update the first-chunk index for chain hashes `keys` leaving a worker's tree."""
        heads = self._heads
        for key in filter(heads.__contains__, keys):
            holders = heads[key]
            holders.pop(worker_id, None)
            if not holders:
                del heads[key]

    def _sweep(self, worker_id: int, now: float, budget: int) -> None:
        """Evict up to `budget` stale items from the head of a worker's tree; drop the tree
        once it holds no entries."""
        tree = self._trees.get(worker_id)
        if tree is None:
            return
        marks = self._marks[worker_id]
        cutoff = now - self.max_age_s
        stale = 0  # marks at the head older than max_age_s: all before the last is stale
        for mark in marks:
            if (tree[mark] or 0.0) >= cutoff:
                break
            stale += 1
        if stale:
            # Evict up to the last stale mark, at most `budget` items this time.
            window = list(map(is_not, islice(tree.values(), budget), repeat(None)))
            at = list(compress(count(), window))  # where the marks are in the window
            n = at[stale - 1] + 1 if len(at) >= stale else len(window)
            self._pop_oldest(worker_id, tree, n, entries=False)
        if not self._sizes[worker_id]:
            del self._trees[worker_id], self._marks[worker_id], self._sizes[worker_id]

    # -- matching: the longest prefix a chain has in the trees of some workers ---------

    def _match(
        self, hashes: list[int], candidates: Mapping[int, int]
    ) -> tuple[int, list[int], list[Tree]]:
        """(d, workers, their trees): the longest match among `candidates` is d chunks, and
        the workers holding that many are among those returned (_holding narrows)."""
        heads = self._heads.get(hashes[0])
        if not heads:
            return 0, [], []
        ids = list(filter(candidates.__contains__, heads))
        if not ids:
            return 0, [], []
        trees = (
            list(heads.values()) if len(ids) == len(heads) else list(map(heads.__getitem__, ids))
        )
        # Binary-search one holder's depth d; then, if anyone in the running holds chunk
        # d + 1, keep only those and search again from there. Usually one round: one tree's
        # O(log chunks) lookups plus one lookup per other worker sharing the prefix.
        depth = held_depth(trees[0], hashes, 1)
        contains = OrderedDict.__contains__
        while len(trees) > 1 and depth < len(hashes):
            key = hashes[depth]
            if not any(map(contains, trees, repeat(key))):
                break
            ids, trees = self._holding(key, ids, trees)
            depth = held_depth(trees[0], hashes, depth + 1)
        return depth, ids, trees

    @staticmethod
    def _holding(key: int, ids: list[int], trees: list[Tree]) -> tuple[list[int], list[Tree]]:
        """The workers among `ids` whose tree holds `key`, and their trees."""
        has = list(map(OrderedDict.__contains__, trees, repeat(key)))
        return list(compress(ids, has)), list(compress(trees, has))

    def tree_size(self, worker_id: int) -> int:
        """Entries (chunks) remembered for a worker, stale ones not swept yet included."""
        return self._sizes.get(worker_id, 0)

    @property
    def entries(self) -> int:
        """Entries over all workers; never more than max_entries after a decision."""
        return self._entries


def held_depth(tree: Tree, hashes: list[int], known: int) -> int:
    """How many leading chunks of the chain `tree` holds, knowing it holds `known` (a
    binary search: what a tree holds is prefix-closed)."""
    if not known:
        if hashes[0] not in tree:
            return 0
        known = 1
    lo, hi = known, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in tree:
            lo = mid
        else:
            hi = mid - 1
    return lo
