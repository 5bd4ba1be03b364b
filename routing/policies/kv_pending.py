"""Blocks a router has just sent to a worker, before the worker's KV events say it stores them.

The exact index (routing.kv_index) learns a prompt's blocks only when the worker stores
them: after the request has reached it, waited for a batch slot and started its prefill,
and the event batch has come back. A burst of requests sharing a prefix that arrives inside
that window would find no worker holding it and be spread by load over every worker, each
then computing (and caching) the same prefix: the cache thrashes. NVIDIA Dynamo's router
counts the blocks of its active sequences for the same reason.

So kv_aware credits the chosen worker with the request's leading blocks at decision time,
and a later request's lookup takes, per worker, the longer of what its events say and what
is credited to it. A credit ends :data:`CONFIRM_SECONDS` after the request's first byte
(the worker has prefilled by then, and vLLM publishes a step's stored blocks with that
step, so its events have come or are about to), at once when the attempt ends without one,
and at the latest ``seconds`` after it was made (kv_aware's knob ``pending_seconds``). So a
credit never stands in for events that should have come: a worker that evicted the blocks,
cleared its cache, or names blocks by other token ids (a tokenizer that is not the
engine's) is seen as its events say as soon as its answer starts.

The credit is this router's own: other routers and replicas learn the blocks from the
worker's events a few milliseconds later. Memory is bounded: at most ``max_blocks``
credited blocks (oldest credits dropped first) and at most ``max_request_blocks`` leading
blocks per request. Keys are routing.kv_index's chain keys, made by the caller's walk.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from routing.kv_holders import blocks

CONFIRM_SECONDS = 0.05  # after the first byte: the subscriber's share of the loop, not the wire
_NOBODY: dict[int, int] = {}


class _Credit:
    __slots__ = ("keys", "owner", "until", "worker_id")

    def __init__(self, worker_id: int, keys: list[int], until: float, owner: object) -> None:
        self.worker_id, self.keys, self.until, self.owner = worker_id, keys, until, owner


class PendingBlocks:
    """Chain key -> {worker id: live credits holding it}; the credits by when they end."""

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
        self._map: dict[int, dict[int, int]] = {}
        self._ends: list[tuple[float, int, _Credit]] = []  # a heap; stale entries skipped
        # id(request) -> its credit; the credit holds the request, so the id stays its own.
        self._by_owner: dict[int, _Credit] = {}
        self._order = itertools.count()
        self._oldest: deque[_Credit] = deque()  # in the order made, for the memory bound
        self._held = 0

    def __len__(self) -> int:
        return len(self._map)

    def credit(self, worker_id: int, keys: list[int], owner: object) -> None:
        """Credit the worker with the blocks `keys` (a prompt's leading chain keys) for the
        request `owner`, until :meth:`confirm` or :meth:`end` of that owner."""
        if self.seconds <= 0 or not keys:
            return
        self.end(owner)  # a retry's new choice replaces the attempt before
        credit = _Credit(worker_id, keys, self._clock() + self.seconds, owner)
        for key in keys:
            holders = self._map.get(key)
            if holders is None:
                self._map[key] = {worker_id: 1}
            else:
                holders[worker_id] = holders.get(worker_id, 0) + 1
        self._by_owner[id(owner)] = credit
        self._schedule(credit)
        oldest = self._oldest
        oldest.append(credit)
        while not oldest[0].keys:  # ended credits leave the head (the new one is live)
            oldest.popleft()
        self._held += len(keys)
        while self._held > self._max_blocks:  # past the bound, the oldest live go first
            while not oldest[0].keys:
                oldest.popleft()
            self._drop(oldest.popleft())

    def confirm(self, owner: object) -> None:
        """The owner's answer has started: its credit ends CONFIRM_SECONDS from now."""
        credit = self._by_owner.get(id(owner))
        if credit is not None and credit.keys:
            credit.until = min(credit.until, self._clock() + CONFIRM_SECONDS)
            self._schedule(credit)

    def end(self, owner: object) -> None:
        """The owner's attempt is over (its answer has ended, or it failed): its credit
        ends now."""
        credit = self._by_owner.pop(id(owner), None)
        if credit is not None:
            self._drop(credit)

    def depths(self, keys: Sequence[int], worker_ids: Iterable[int]) -> dict[int, int]:
        """Leading blocks of `keys` credited to each of `worker_ids` (absent: none).

        Each credit covers a prompt's leading blocks, so a worker credited with a block is
        credited with every block before it: the depth is found by binary search, a few
        lookups a worker however long the prompt."""
        self._expire()  # what is left in the map is credited now
        first = self._map.get(keys[0]) if keys else None
        if not first:
            return {}
        get, found = self._map.get, {}
        for worker_id in worker_ids:
            if worker_id not in first:
                continue
            low, high = 1, len(keys)  # keys[:low] are credited to it
            while low < high:
                mid = (low + high + 1) // 2
                if worker_id in get(keys[mid - 1], _NOBODY):
                    low = mid
                else:
                    high = mid - 1
            found[worker_id] = low
        return found

    def _schedule(self, credit: _Credit) -> None:
        heapq.heappush(self._ends, (credit.until, next(self._order), credit))

    def _expire(self) -> None:
        now, ends = self._clock(), self._ends
        while ends and ends[0][0] <= now:
            until, _, credit = heapq.heappop(ends)
            if until == credit.until:  # else moved earlier, and ended by that entry
                self._drop(credit)

    def _drop(self, credit: _Credit) -> None:
        """Take the credit's blocks back; a block stays while another credit holds it."""
        worker_id, keys = credit.worker_id, credit.keys
        if not keys:
            return  # dropped already
        credit.keys = []
        self._held -= len(keys)
        if self._by_owner.get(id(credit.owner)) is credit:
            del self._by_owner[id(credit.owner)]
        credit.owner = None
        for key in keys:
            holders = self._map[key]
            left = holders[worker_id] - 1
            if left:
                holders[worker_id] = left
            else:
                del holders[worker_id]
                if not holders:
                    del self._map[key]


def extend_chain(
    keys: list[int], token_ids: Sequence[int], seed: int, size: int, upto: int
) -> None:
    """Hash the chain keys of `token_ids` after those in `keys`, up to `upto` blocks, in place
    (routing.kv_index's chain: ``hash((previous key, block))``, from `seed`)."""
    done = len(keys)
    if done >= upto:
        return
    key = keys[-1] if keys else seed
    start = done * size
    for block in blocks(token_ids[start : upto * size], size):
        key = hash((key, block))
        keys.append(key)
