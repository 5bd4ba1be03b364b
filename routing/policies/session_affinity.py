"""Session affinity: every request of a session goes to the same worker, while it can take it.

vLLM's prefix cache makes the next turn of a conversation much cheaper on the worker that
served the previous one, so a session should stick to a worker. The session key is the one
the router read for the request (routing.sessions: the first of the configured headers,
X-Session-ID, Claude Code's, OpenCode's and Codex's by default, then the OpenAI `user`
field), unless the model's `header` knob names a header of its own, which then goes first.
Empty values count as absent.

Which worker a key maps to
--------------------------
Multi-probe consistent hashing (Appleton & O'Reilly, 2015) with 32 points per worker. Each
worker has 32 points on a ring of 2**64 positions, the little-endian 64-bit words of
shake_128(b"worker:%d" % worker.id); each key has 8 probes, the words of
shake_128(b"key:" + the key in UTF-8). A worker's score for a key is the shortest clockwise
distance from any of the key's probes to any of the worker's points, and the workers given
are ranked by it, lowest first: the first is the key's worker, the rest the order overflow
follows. That is a rendezvous scheme (a score per key and worker, depending on nothing
else), so:

* every router process, before and after a restart, maps a key to the same worker
  (Python's hash() is salted per process and would not do);
* when a worker leaves the list (drained, unhealthy: the router only passes routable
  workers) only the sessions that were on it move, each to its own next-ranked worker, so
  they spread over the rest; when one joins, it only takes sessions, each from whichever
  worker had it, about 1/(n+1) of them;
* a worker's share of the keys is 1/n give or take a few percent, not exactly 1/n as with
  rendezvous hashing's one hash per key and worker: the points are not spread perfectly
  evenly. Measured (tests/unit/routing/policies/test_policies.py, and 300,000 keys over
  fleets of 20 to 200), the shares' standard deviation is about 5 % of 1/n, the extremes
  within about 20 %.

Why not plain rendezvous hashing: it hashes the key with every worker, about 0.5 µs each in
Python: 0.5 ms for a session's first request at 1,000 workers. Here a key's first ranks cost
one shake_128, 8 binary searches over the sorted points and a few heap steps: about 10-15 µs
whatever the fleet's size. The sorted ring is built when a worker id joins (about 20 ms and
3.5 MB for 1,000 workers: 32,000 points, kept twice over so that a walk need not wrap) and
kept while workers only leave, until the ids on it not given outnumber those given (by more
than 8): a worker that left or is ejected, or a retry's shorter list, only means the ranking
skips the ids not given, and the cache below stays valid.

Load
----
A worker whose load (routing.policies.load: the same for every router) is above `max_load`
is passed over for the next worker in the key's order that is not; if every worker is above
it, the least loaded takes the request (the higher-ranked on a tie). A request without a
session key goes to the least loaded worker (the earlier in the list on a tie; no
randomness): a scan below 128 workers, a `LoadIndex` from 128 on (the
same answer while only this policy's requests change its workers' in-flight counts; see
routing.policies.load_index).

Decisions counted: "affinity" (the key's own worker), "overflow" (another worker, because
the key's own was overloaded), "no_key" (no session key: least loaded).

Config knobs:

* `header` (string, default: none): a request header this model reads before the router's
  session key (CONTROLPANEL_SESSION_HEADERS), for a client that names its sessions in a
  header of its own. Without it the policy reads only the router's key, so it never
  re-reads the request's headers.
* `max_load` (integer >= 0, default 32): the load above which a worker is passed over.
* `cache_size` (integer >= 0, default 65536): how many session keys remember their first
  four workers on the ring, so a known session costs one dictionary lookup (and overflow to
  them no hashing). The cache lives as long as the ring (a new worker id empties it); a full
  cache is emptied and refills. Keys over 256 characters are not cached, which bounds the
  memory. 0 disables the cache. Only a request whose key's four are all overloaded or not
  given reads every worker's load and walks the ring further, to the first worker at or
  under `max_load` (or, with none, to the first of the least loaded): rare, and the longer
  the walk the busier the fleet.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterator, Mapping, Sequence
from hashlib import shake_128
from heapq import heapify, heapreplace
from itertools import islice, repeat
from operator import sub
from struct import Struct
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import NO_WORKER, BasePolicy, Choice, Explanation, RequestInfo
from routing.policies.load import check_keys, integer, least_loaded, load_of
from routing.policies.load_index import LoadIndex

MAX_CACHED_KEY = 256
CACHED_RANKS = 4  # the first workers of a key's order that the cache remembers
RING_POINTS = 32  # points per worker on the ring
PROBES = 8  # probes per key
_RING = 1 << 64
_WORDS = Struct(f"<{RING_POINTS}Q")
_PROBE_WORDS = Struct(f"<{PROBES}Q")


class SessionAffinityPolicy(BasePolicy):
    name = "session_affinity"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        check_keys(self.name, self.config, ("header", "max_load", "cache_size"))
        configured = self.config.get("header")
        self.header = None if configured is None else _header_name(configured)
        self.max_load = integer(self.name, self.config, "max_load", 32, minimum=0)
        self.cache_size = integer(self.name, self.config, "cache_size", 65536, minimum=0)
        self._workers: Sequence[WorkerView] | None = None
        self._size = 0
        self._by_id: dict[int, WorkerView] = {}
        self._loads = LoadIndex()  # for requests without a key, from 128 workers
        # The ring: every point twice (the second time + 2**64, so a probe past the last
        # point walks on without wrapping), sorted, and the worker id owning each.
        self._ring_ids: set[int] = set()
        self._points: list[int] = []
        self._owners: list[int] = []
        self._cache: dict[str, tuple[int, ...]] = {}  # session key -> its leaders' ids

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Choice:
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        if not workers:
            return Choice(None, NO_WORKER)
        key = self.session_key(request)
        if key is None:
            self.decisions["no_key"] += 1
            if self._loads.use(workers, loads):
                return Choice(workers[self._loads.least(loads)], "no_key")
            return Choice(least_loaded(workers, loads), "no_key")
        ranks = self._cache.get(key) or self._leaders(key)
        by_id, max_load = self._by_id, self.max_load
        first = True
        for worker_id in ranks:
            worker = by_id.get(worker_id)
            if worker is None:  # not given (gone, ejected, tried): the next one's turn
                continue
            if loads.get(worker_id, 0) <= max_load:
                decision = "affinity" if first else "overflow"
                self.decisions[decision] += 1
                return Choice(worker, decision)
            first = False
        return self._overflow(key, loads)

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        self._loads.touch(worker.id)

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        self._loads.touch(worker.id)

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """The session's ranking of the workers (rank 0 is its own) with their loads and
        whether each is over max_load; without a key, the loads."""
        key = self.session_key(request)
        if key is None:
            told = super().explain(workers, request, loads)
            return Explanation("no_key", least_loaded(workers, loads), told.candidates)
        ranked = self.ranking(workers, key)
        rows = [
            {"worker": w.name, "rank": n, "load": loads.get(w.id, 0),
             "over_max_load": loads.get(w.id, 0) > self.max_load}
            for n, w in enumerate(ranked)
        ]  # fmt: skip
        below = [w for w in ranked if loads.get(w.id, 0) <= self.max_load]
        if below:
            chosen = below[0]
        else:
            low = min(loads.get(w.id, 0) for w in ranked)
            chosen = next(w for w in ranked if loads.get(w.id, 0) == low)
        return Explanation("affinity" if chosen is ranked[0] else "overflow", chosen, rows)

    def session_key(self, request: RequestInfo) -> str | None:
        """The model's own header when it has one and the request carries it, else the
        router's session key (routing.sessions); None when there is neither."""
        if self.header is not None and (key := request.header(self.header)):
            return key
        return request.session

    def ranking(self, workers: Sequence[WorkerView], key: str) -> list[WorkerView]:
        """`workers` in the key's order, best first: the order overflow follows. Walks the
        whole ring (O(points x probes) at worst): for tests and tools, not for requests."""
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        by_id = self._by_id
        return [by_id[worker_id] for worker_id in self._order(key) if worker_id in by_id]

    def _leaders(self, key: str) -> tuple[int, ...]:
        """The ids of the key's first CACHED_RANKS workers on the ring, remembered."""
        ranks = tuple(islice(self._order(key), CACHED_RANKS))
        if len(key) <= MAX_CACHED_KEY and self.cache_size:
            if len(self._cache) >= self.cache_size:
                self._cache.clear()  # O(1) amortised; a FIFO pop from a dict's front is not
            self._cache[key] = ranks
        return ranks

    def _order(self, key: str) -> Iterator[int]:
        """Every worker id on the ring, each once, by its score for `key`, lowest first
        (ties, at odds of about 2**-64, by ring position). Each probe walks the ring
        clockwise; a heap merges the walks by distance, and a worker is yielded at its first
        point reached. Lazy: the first few cost a few heap steps."""
        points, owners, total = self._points, self._owners, len(self._ring_ids)
        if not total:
            return
        probes = _PROBE_WORDS.unpack(shake_128(b"key:" + _utf8(key)).digest(8 * PROBES))
        half = len(points) // 2
        starts = list(map(bisect_left, repeat(points), probes, repeat(0), repeat(half)))
        distances = map(sub, map(points.__getitem__, starts), probes)
        walks = list(zip(distances, starts, probes, strict=True))
        heapify(walks)
        seen: set[int] = set()
        while True:  # a probe never walks past its start + half: all owners are seen by then
            _, at, probe = walks[0]
            owner = owners[at]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == total:
                    return
            heapreplace(walks, (points[at + 1] - probe, at + 1, probe))

    def _overflow(self, key: str, loads: Mapping[int, int]) -> Choice:
        """Every remembered leader is overloaded or not given (rare): the next worker in
        the key's order at or under max_load; if none is, the least loaded, the
        higher-ranked on a tie. Both are the first in order at or under a bar."""
        loads = {worker_id: load_of(w, loads) for worker_id, w in self._by_id.items()}
        bar = max(self.max_load, min(loads.values()))
        top: int | None = None
        for worker_id in self._order(key):
            load = loads.get(worker_id)
            if load is None:
                continue
            if top is None:
                top = worker_id
            if load <= bar:
                decision = "affinity" if worker_id == top else "overflow"
                self.decisions[decision] += 1
                return Choice(self._by_id[worker_id], decision)
        raise AssertionError("unreachable: every worker given is on the ring")

    def _index(self, workers: Sequence[WorkerView]) -> None:
        """Once per worker list (the router passes its snapshot's tuple until the next
        swap). The ring, and with it the cache, is rebuilt only when an id joins or when
        the ids on it not given outnumber those given (by more than 8)."""
        self._workers, self._size = workers, len(workers)
        self._by_id = {w.id: w for w in workers}
        given = self._by_id.keys()
        if given and (not given <= self._ring_ids or len(self._ring_ids) > 2 * len(given) + 8):
            self._build_ring(given)

    def _build_ring(self, worker_ids: Collection[int]) -> None:
        """The ring of `worker_ids`' points; a new ring ranks keys anew: the cache empties."""
        owner: dict[int, int] = {}  # point -> worker id (points collide at odds of 2**-64)
        for worker_id in worker_ids:
            words = _WORDS.unpack(shake_128(b"worker:%d" % worker_id).digest(8 * RING_POINTS))
            owner.update(zip(words, repeat(worker_id)))
        points = sorted(owner)
        self._points = points + [point + _RING for point in points]
        self._owners = list(map(owner.__getitem__, points)) * 2
        self._ring_ids = set(worker_ids)
        self._cache.clear()


def _utf8(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def _header_name(value: Any) -> bytes:
    """The header name as the ASGI server gives it: lower-case latin-1 bytes."""
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ValueError(f"session_affinity: header must be a header name, not {value!r}")
    try:
        return value.lower().encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(
            f"session_affinity: header must be a latin-1 header name, not {value!r}"
        ) from None
