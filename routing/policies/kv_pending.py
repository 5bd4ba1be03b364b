"""Blocks a router has just sent to a worker, before the worker's KV events say it stores them.

The exact index (routing.kv.kv_index) learns a prompt's blocks only when the worker stores
them: after the request has reached it, waited for a batch slot and started its prefill,
and the event batch has come back. A burst of requests sharing a prefix that arrives inside
that window would find no worker holding it and be spread by load over every worker, each
then computing (and caching) the same prefix: the cache thrashes. NVIDIA Dynamo's router
counts the blocks of its active sequences for the same reason.

So kv_aware credits the chosen worker, at decision time, with the request's blocks past
those its events already show, and a later request's lookup counts, per worker, what its
events show and the credit that goes on from there. A credit ends CONFIRM_SECONDS after
the request's first byte (the worker has prefilled by then, and vLLM publishes a step's
stored blocks with that step, so its events have come or are about to), at once when the
attempt ends without one, and at the latest ``seconds`` after it was made (kv_aware's knob
``pending_seconds``). So a credit never stands in for events that should have come: a
worker that evicted the blocks, cleared its cache, or names blocks by other token ids (a
tokenizer that is not the engine's) is seen as its events say once its answer starts.

The credit is this router's own: other routers and replicas learn the blocks from the
worker's events a few milliseconds later. Memory is bounded: at most ``max_blocks``
credited blocks (oldest credits dropped first), up to block ``max_request_blocks`` of a
prompt. Keys are routing.kv.kv_index's chain keys. A credit is kept whole, filed under the key
of its first block (which the index's walk found), and its later keys are hashed only when
a lookup compares them, by binary search (a chain key stands for every block before it): a
credit nobody asks about costs a few operations however long the prompt.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence

CONFIRM_SECONDS = 0.05  # after the first byte: the subscriber's share of the loop, not the wire


class LazyChain:
    """A prompt's chain keys from block `start` (whose key is known) up to block `end`,
    each hashed the first time it is asked for."""

    __slots__ = ("_keys", "_size", "_start", "_tokens", "end")

    def __init__(
        self, tokens: Sequence[int], size: int, start: int, first_key: int, end: int
    ) -> None:
        self._tokens, self._size, self._start, self.end = tokens, size, start, end
        self._keys = [first_key]

    def __len__(self) -> int:
        return self.end - self._start

    def key(self, i: int) -> int:
        """The key of block start + i (i < len(self))."""
        keys = self._keys
        if i < len(keys):
            return keys[i]
        tokens, size, key = self._tokens, self._size, keys[-1]
        for block in range(self._start + len(keys), self._start + i + 1):
            key = hash((key, tuple(tokens[block * size : (block + 1) * size])))
            keys.append(key)
        return key


class _Credit:
    __slots__ = ("chain", "owner", "until", "worker_id")

    def __init__(self, worker_id: int, chain: LazyChain, until: float, owner: object) -> None:
        self.worker_id, self.until, self.owner = worker_id, until, owner
        self.chain: LazyChain | None = chain  # None once dropped


class PendingBlocks:
    """Live credits filed by the key of their first block, and by when they end."""

    def __init__(
        self,
        seconds: float,
        clock: Callable[[], float],
        *,
        max_blocks: int = 200_000,
        max_request_blocks: int = 256,
    ) -> None:
        self.seconds = seconds
        self.max_request_blocks = max_request_blocks
        self._max_blocks = max_blocks
        self._clock = clock
        self._by_start: dict[int, list[_Credit]] = {}
        self._ends: list[tuple[float, int, _Credit]] = []  # a heap; stale entries skipped
        # id(request) -> its credit; the credit holds the request, so the id stays its own.
        self._by_owner: dict[int, _Credit] = {}
        self._order = itertools.count()
        self._oldest: deque[_Credit] = deque()  # in the order made, for the memory bound
        self.blocks = 0  # credited, over every live credit

    def __len__(self) -> int:
        """Live credits."""
        return len(self._by_owner)

    def credit(self, worker_id: int, chain: LazyChain, owner: object) -> None:
        """Credit the worker with the blocks of `chain` (a prompt's, from the first its
        events do not show) for the request `owner`, until :meth:`confirm` or :meth:`end`
        of that owner."""
        if self.seconds <= 0 or not len(chain):
            return
        self.end(owner)  # a retry's new choice replaces the attempt before
        credit = _Credit(worker_id, chain, self._clock() + self.seconds, owner)
        self._by_start.setdefault(chain.key(0), []).append(credit)
        self._by_owner[id(owner)] = credit
        heapq.heappush(self._ends, (credit.until, next(self._order), credit))
        oldest = self._oldest
        oldest.append(credit)
        while oldest[0].chain is None:  # ended credits leave the head (the new one is live)
            oldest.popleft()
        self.blocks += len(chain)
        while self.blocks > self._max_blocks:  # past the bound, the oldest live go first
            while oldest[0].chain is None:
                oldest.popleft()
            self._drop(oldest.popleft())

    def confirm(self, owner: object) -> None:
        """The owner's answer has started: its credit ends CONFIRM_SECONDS from now."""
        credit = self._by_owner.get(id(owner))
        if credit is not None:
            credit.until = min(credit.until, self._clock() + CONFIRM_SECONDS)
            heapq.heappush(self._ends, (credit.until, next(self._order), credit))

    def end(self, owner: object) -> None:
        """The owner's attempt is over (its answer has ended, or it failed): its credit
        ends now."""
        credit = self._by_owner.get(id(owner))
        if credit is not None:
            self._drop(credit)

    def depths(self, chains: Mapping[int, LazyChain], asker: object = None) -> dict[int, int]:
        """For each worker, how many blocks of its `chains` entry (the prompt from the first
        block its events do not show) its credits hold (absent: none). The credit of the
        asking request itself does not count: it stands for the blocks that very request
        is to compute."""
        self._expire()  # every credit left is live
        found: dict[int, int] = {}
        if not self._by_start:
            return found
        for worker_id, chain in chains.items():
            filed = self._by_start.get(chain.key(0))
            if not filed:
                continue
            best = 0
            for credit in filed:
                if (
                    credit.worker_id == worker_id
                    and credit.chain is not None
                    and credit.owner is not asker
                ):
                    best = max(best, _matched(credit.chain, chain))
            if best:
                found[worker_id] = best
        return found

    def _expire(self) -> None:
        now, ends = self._clock(), self._ends
        while ends and ends[0][0] <= now:
            until, _, credit = heapq.heappop(ends)
            if until == credit.until:  # else moved earlier, and ended by that entry
                self._drop(credit)

    def _drop(self, credit: _Credit) -> None:
        chain = credit.chain
        if chain is None:
            return  # dropped already
        credit.chain = None
        self.blocks -= len(chain)
        if self._by_owner.get(id(credit.owner)) is credit:
            del self._by_owner[id(credit.owner)]
        credit.owner = None
        first = chain.key(0)
        filed = self._by_start[first]
        filed.remove(credit)
        if not filed:
            del self._by_start[first]


def _matched(credited: LazyChain, asked: LazyChain) -> int:
    """How many leading keys the two chains share (their first is shared by filing). A
    chain key stands for every block before it, so sharing a key at one depth means sharing
    all before it: binary search, hashing only the keys it probes."""
    low, high = 1, min(len(credited), len(asked))
    while low < high:
        mid = (low + high + 1) // 2
        if credited.key(mid - 1) == asked.key(mid - 1):
            low = mid
        else:
            high = mid - 1
    return low
