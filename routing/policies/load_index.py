"""The least loaded worker of a big fleet without looking at every worker.

A worker's load is what the router's ``loads`` mapping says (the rule is in
routing.policies.load). Finding the least loaded by a scan costs a pass over
every worker; from INDEX_MIN_WORKERS (128) workers on, a policy can ask a `LoadIndex`
instead: a lazy min-heap of ``(load, tie key, position, version)`` entries, one current entry
per worker, so a decision costs O(log n) plus the entries it finds out of date.

How it stays right
------------------
* The router passes the same worker tuple until the next snapshot swap. The index is built
  for a tuple the second time in a row it is passed (the first decision scans, as a policy
  does below the threshold), and kept while it is passed again: a one-off tuple in between
  (a retry's, an admission subset's, one made per request while a worker is ejected) is
  scanned and never costs a build. A new ``loads`` mapping object also means a rebuild:
  the router always passes the same live dict. So does a new ``loads.version``
  (routing.fleet.load_signal moves it when its periodic refresh changed loads behind the hooks'
  backs: another router's requests, a new report), so falls are seen within a refresh.
* The router changes in-flight counts around the policy's hooks (+1 just before
  `on_request_start`, -1 just before `on_request_complete`); the hooks call `touch`, and the
  next decision re-pushes those workers with their live load (a new version; the old entry
  is dropped when it surfaces). The worker a decision picks is re-pushed the same way, so
  callers that skip the hooks (tests, benchmarks) still see fresh random tie keys.
* Before the top entry is used its load is checked against the live one; a mismatch is
  re-pushed and the next one checked. So a load that *rose* unseen (another model's policy
  sending to a worker both serve, which this instance's hooks never hear about) is always
  caught; one that *fell* unseen is caught by the rebuild every REBUILD_EVERY (256)
  decisions over the index. With no such sharing, the answer is exact.
* The heap holds one current entry per worker plus superseded ones, and is rebuilt when it
  would pass ``workers + 2 x REBUILD_EVERY`` entries.

Ties: with an `rng`, tied workers are ordered by a random key drawn whenever the worker's
entry is pushed (at a build, and after each change of its load, each pick and each
`least_tied` sample), so which tied worker comes first is random. Successive decisions are
not independent draws, though, as a scan's `random.choice` is: a key that has survived
earlier decisions is likely a large one, so a worker re-keyed since (picked, or back down
from a higher load) is more likely than the others to come next. Without an `rng`, ties go
to the earlier in the list: `least_loaded`'s order.

Costs at 1,000 workers (CPython 3.11, bench/decision_cost/run.py's machine): reading a new
tuple's ids about 0.13 ms and a build about 0.2 ms (once per snapshot tuple, and
a build per 256 decisions: under 1 µs a decision amortised), a decision a few µs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from heapq import heapify, heappop, heappush, heapreplace
from itertools import repeat
from operator import attrgetter

from routing.fleet.snapshot import WorkerView

INDEX_MIN_WORKERS = 128  # below this, policies scan: exact, and already a few µs
REBUILD_EVERY = 256  # decisions over the index between rebuilds: bounds unseen decreases

_ID = attrgetter("id")
# (load, tie key, position in the tuple, version); the position is unique, so versions
# are never compared.
_Entry = tuple[int, float, int, int]


class LoadIndex:
    """A lazy min-heap of worker loads for one policy instance (see the module docstring).

    Use: ``if index.use(workers, loads):`` then `least`, `min_load` or `least_tied` for
    this decision (positions in `workers`), and `touch(worker_id)` from the policy's
    on_request_start and on_request_complete hooks."""

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        min_workers: int = INDEX_MIN_WORKERS,
        rebuild_every: int = REBUILD_EVERY,
    ) -> None:
        self.min_workers = min_workers
        self.rebuild_every = rebuild_every
        self._random = rng.random if rng is not None else None
        self._workers: tuple[WorkerView, ...] | None = None  # the indexed tuple
        self._seen: tuple[WorkerView, ...] | None = None  # passed once, indexed if it returns
        self._loads_seen: Mapping[int, int] | None = None
        self._ids: list[int] = []
        self._loads_version = -1
        self._pos: dict[int, int] = {}
        self._heap: list[_Entry] = []
        self._versions: list[int] = []
        self._dirty: set[int] = set()
        self._countdown = 0
        self.builds = 0  # for tests and the curious

    def use(self, workers: Sequence[WorkerView], loads: Mapping[int, int]) -> bool:
        """True when this decision over `workers` goes through the index (brought up to
        date here); False when the caller should scan: a small fleet, a list, or a tuple
        passed for the first time."""
        if workers is not self._workers:
            if len(workers) < self.min_workers or not isinstance(workers, tuple):
                return False
            if workers is not self._seen:
                self._seen = workers
                return False
            self._fleet(workers)
            self._build(loads)
        elif (
            loads is not self._loads_seen
            or getattr(loads, "version", 0) != self._loads_version
            or self._countdown <= 0
            or len(self._heap) + len(self._dirty) > len(self._ids) + 2 * self.rebuild_every
        ):
            self._build(loads)
        elif self._dirty:
            self._refresh(loads)
        self._seen = None  # "in a row": another tuple in between starts the count again
        self._countdown -= 1
        return True

    def touch(self, worker_id: int) -> None:
        """The worker's in-flight count changed (a policy hook): re-read it next decision."""
        if self._workers is not None:
            self._dirty.add(worker_id)

    def least(self, loads: Mapping[int, int]) -> int:
        """The position of a least loaded worker (ties as the module docstring says); it
        gets a fresh entry at the next decision, since it is about to get a request."""
        at = self._top(loads)[2]
        self._dirty.add(self._ids[at])
        return at

    def min_load(self, loads: Mapping[int, int]) -> int:
        """The least load of any worker."""
        return self._top(loads)[0]

    def least_tied(self, loads: Mapping[int, int], limit: int) -> list[int]:
        """Positions of up to `limit` workers tied at the least load, in tie-key order. With
        an rng they are a random sample of the tied ones, and they go back with fresh random
        keys: a caller that picks among them by some other measure (prefix_aware: the
        smallest tree) would otherwise leave the ones it passes over at the front, and
        every later sample would be made of them."""
        heap, taken = self._heap, list[_Entry]()
        low = self._top(loads)[0]
        while len(taken) < limit:
            taken.append(heappop(heap))
            if not heap or self._top(loads)[0] != low:
                break
        for load, tie, at, version in taken:  # still current and right
            heappush(heap, (load, self._random() if self._random else tie, at, version))
        return [entry[2] for entry in taken]

    def _top(self, loads: Mapping[int, int]) -> _Entry:
        """The heap's first current entry whose load is still the live one. Terminates:
        every worker always has one current entry, and one re-pushed here is right."""
        heap, versions, ids = self._heap, self._versions, self._ids
        while True:
            entry = heap[0]
            load, _, at, version = entry
            if version != versions[at]:
                heappop(heap)  # superseded by a later push
                continue
            live = loads.get(ids[at], 0)
            if live == load:
                return entry
            versions[at] = version + 1  # changed without a hook: re-push, look again
            heapreplace(heap, (live, self._tie(at), at, version + 1))

    def _tie(self, at: int) -> float:
        return self._random() if self._random is not None else 0.0

    def _fleet(self, workers: tuple[WorkerView, ...]) -> None:
        """Per tuple: ids and id -> position."""
        self._workers = workers
        self._ids = list(map(_ID, workers))
        self._pos = {worker_id: at for at, worker_id in enumerate(self._ids)}

    def _build(self, loads: Mapping[int, int]) -> None:
        """Every worker's entry afresh, from the live loads."""
        ids = self._ids
        now = list(map(loads.get, ids, repeat(0)))
        if self._random is not None:
            draw = self._random
            ties: list[float] = [draw() for _ in ids]
        else:
            ties = [0.0] * len(ids)
        self._heap = list(zip(now, ties, range(len(ids)), repeat(0)))
        heapify(self._heap)
        self._versions = [0] * len(ids)
        self._dirty.clear()
        self._loads_seen = loads
        self._loads_version = getattr(loads, "version", 0)
        self._countdown = self.rebuild_every
        self.builds += 1

    def _refresh(self, loads: Mapping[int, int]) -> None:
        """A new entry, with the live load, for every worker the hooks touched."""
        heap, versions, pos = self._heap, self._versions, self._pos
        for worker_id in self._dirty:
            at = pos.get(worker_id)
            if at is None:  # a worker of another list (a retry's, one that left)
                continue
            version = versions[at] = versions[at] + 1
            load = loads.get(worker_id, 0)
            heappush(heap, (load, self._tie(at), at, version))
        self._dirty.clear()
