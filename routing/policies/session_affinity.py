"""Session affinity: every request of a session goes to the same worker, while it can take it.

vLLM's prefix cache makes the next turn of a conversation much cheaper on the worker that
served the previous one, so a session should stick to a worker. The session key is the value
of a request header (`header`, default X-Session-ID, matched case-insensitively) or, without
it, the OpenAI `user` field of the body. Empty values count as absent.

The key is mapped to a worker by rendezvous (highest random weight) hashing: every worker
gets the score blake2b(f"{key}:{worker.id}", digest_size=8) and the highest score wins. The
score depends on nothing but the key and the worker id, so every router process, before and
after a restart, maps a key to the same worker (Python's hash() is salted per process and
would not). And when a worker leaves the list (drained, unhealthy: the router only passes
routable workers), only the sessions that were on it move, each to its own next-highest
worker, so they spread over the rest; when one joins, it takes about 1/(n+1) of the sessions.

A worker whose load (in-flight from this router + reported queue length) is above `max_load`
is passed over for the next worker in the key's rendezvous order that is not; if every worker
is above it, the least loaded takes the request (the higher-ranked on a tie). A request
without a session key goes to the least loaded worker (the earlier on a tie, no randomness).

Decisions counted: "affinity" (the key's own worker), "overflow" (another worker, because
the key's own was overloaded), "no_key" (no session key: least loaded).

Config knobs:

* `header` (string, default "X-Session-ID"): the request header carrying the session key.
* `max_load` (integer >= 0, default 32): the load above which a worker is passed over.
* `cache_size` (integer >= 0, default 65536): how many session keys remember their workers.
  Scoring every worker costs about 0.5 µs per worker (0.5 ms for a thousand), so the first
  four workers of a key's order are cached until the set of worker ids changes (overflow
  to them costs no hashing either; only a key whose four are all overloaded pays for the
  full order). A full cache is emptied and refills. Keys over 256 characters are not
  cached, which bounds the memory. 0 disables the cache.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

from routing.policies.base import BasePolicy, RequestInfo
from routing.policies.load import by_queue_length, check_keys, integer, least_loaded, load_of
from routing.snapshot import WorkerView

MAX_CACHED_KEY = 256
CACHED_RANKS = 4  # the first workers of a key's rendezvous order that the cache remembers


class SessionAffinityPolicy(BasePolicy):
    name = "session_affinity"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        check_keys(self.name, self.config, ("header", "max_load", "cache_size"))
        self.header = _header_name(self.config.get("header", "X-Session-ID"))
        self.max_load = integer(self.name, self.config, "max_load", 32, minimum=0)
        self.cache_size = integer(self.name, self.config, "cache_size", 65536, minimum=0)
        self._workers: Sequence[WorkerView] | None = None
        self._size = 0
        self._salted: tuple[tuple[bytes, int], ...] = ()  # (str(id) as bytes, id)
        self._by_id: dict[int, WorkerView] = {}
        self._by_queue: tuple[WorkerView, ...] = ()
        self._cache: dict[str, tuple[int, ...]] = {}  # session key -> its leaders' ids

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, inflight: Mapping[int, int]
    ) -> WorkerView | None:
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        if not workers:
            return None
        key = self.session_key(request)
        if key is None:
            self.decisions["no_key"] += 1
            return least_loaded(self._by_queue, inflight)
        ranks = self._cache.get(key) or self._leaders(key)
        by_id, max_load = self._by_id, self.max_load
        for worker_id in ranks:
            worker = by_id[worker_id]
            if inflight.get(worker_id, 0) + (worker.queue_length or 0) <= max_load:
                self.decisions["affinity" if worker_id == ranks[0] else "overflow"] += 1
                return worker
        return self._overflow(key, ranks[0], inflight)

    def session_key(self, request: RequestInfo) -> str | None:
        """The configured header's value, else the body's `user`; None when neither is set."""
        key = request.header(self.header)
        if key:
            return key
        user = request.body.get("user")
        return user if isinstance(user, str) and user else None

    def ranking(self, workers: Sequence[WorkerView], key: str) -> list[WorkerView]:
        """`workers` in the key's rendezvous order, best first: the order overflow follows."""
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        return [self._by_id[worker_id] for worker_id in self._ranking(key)] if workers else []

    def _leaders(self, key: str) -> tuple[int, ...]:
        """The ids of the key's first CACHED_RANKS workers in rendezvous order, remembered.
        One pass of blake2b over the workers: the hash of `key:` is computed once and copied;
        a digest below the current last leader is dismissed with one bytes comparison (8-byte
        digests compare as bytes the way they would as big-endian integers)."""
        base = _key_hash(key)
        keep = min(CACHED_RANKS, len(self._salted))
        leaders: list[tuple[bytes, int]] = []  # ascending; leaders[0] is the last of them
        floor = b""
        for salt, worker_id in self._salted:
            h = base.copy()
            h.update(salt)
            digest = h.digest()
            if digest < floor:
                continue
            insort(leaders, (digest, worker_id))
            if len(leaders) > keep:
                del leaders[0]
            if len(leaders) == keep:
                floor = leaders[0][0]
        ranks = tuple(worker_id for _, worker_id in reversed(leaders))
        self._remember(key, ranks)
        return ranks

    def _remember(self, key: str, ranks: tuple[int, ...]) -> None:
        if len(key) > MAX_CACHED_KEY or not self.cache_size:
            return
        if len(self._cache) >= self.cache_size:
            self._cache.clear()  # O(1) amortised; a FIFO pop from a dict's front is not
        self._cache[key] = ranks

    def _ranking(self, key: str) -> list[int]:
        """Every worker id in the key's rendezvous order (ties, at odds of 2**-64, to the
        larger id)."""
        base = _key_hash(key)
        scored = []
        for salt, worker_id in self._salted:
            h = base.copy()
            h.update(salt)
            scored.append((h.digest(), worker_id))
        scored.sort(reverse=True)
        return [worker_id for _, worker_id in scored]

    def _overflow(self, key: str, top_id: int, inflight: Mapping[int, int]) -> WorkerView:
        """Every remembered leader is overloaded (rare): the next worker in the full
        rendezvous order at or under max_load; if none is, the least loaded, the
        higher-ranked on a tie."""
        order = [self._by_id[worker_id] for worker_id in self._ranking(key)]
        chosen = next((w for w in order if load_of(w, inflight) <= self.max_load), None)
        if chosen is None:
            chosen = min(order, key=lambda w: load_of(w, inflight))  # min keeps the first
        self.decisions["affinity" if chosen.id == top_id else "overflow"] += 1
        return chosen

    def _index(self, workers: Sequence[WorkerView]) -> None:
        """Once per snapshot (the router passes the same tuple object until the next swap).
        The cache survives a snapshot that keeps the same worker ids (most snapshots only
        carry new load figures); any change of ids empties it, because a joining worker
        takes over some keys and a leaving one gives its keys away."""
        if {w.id for w in workers} != self._by_id.keys():
            self._cache.clear()
        self._workers, self._size = workers, len(workers)
        self._salted = tuple((str(w.id).encode(), w.id) for w in workers)
        self._by_id = {w.id: w for w in workers}
        self._by_queue = by_queue_length(workers)


def _key_hash(key: str) -> blake2b:
    """blake2b state after `key:`, to be copied and finished with each worker id."""
    return blake2b(key.encode("utf-8", "surrogatepass") + b":", digest_size=8)


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
