"""The waiting room of one model: by priority class first, then fair between keys.

routing.admission parks a request here when no worker has room for it. When room appears
the queue wakes one waiter: the head of the highest class that has any (`critical`, then
`standard`; `sheddable` requests never wait, they are shed), and within a class the one
with the smallest start tag, which is start-time fair queuing between flows (client keys):

* A flow's waiting request gets the tag ``max(virtual time, the flow's last tag) +
  1 / weight``, and the virtual time moves to each woken request's tag.
* So while two flows both have requests waiting, they are woken in the ratio of their
  weights (a weight-3 key gets three turns for each turn of a weight-1 key) however many
  requests either one queues: a flood only lengthens its own flow.
* A flow that was idle starts at the virtual time, not at its old tag: it cannot bank turns
  while it sends nothing, nor be punished for what it sent long ago.

A woken waiter that still finds no room (another router took the slot, or its class may
not use it) goes back with its own tag, so it keeps its place at the head.
"""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field
from itertools import count

WAITING_CLASSES = 2  # ranks 0 (critical) and 1 (standard); sheddable is never queued


@dataclass(order=True, slots=True)
class Waiter:
    tag: float
    seq: int
    rank: int = field(compare=False)
    turn: asyncio.Future[None] = field(compare=False)
    flow: int = field(compare=False, default=0)


class FairQueue:
    def __init__(self) -> None:
        self._heaps: tuple[list[Waiter], ...] = tuple([] for _ in range(WAITING_CLASSES))
        self._last_tag: tuple[dict[int, float], ...] = tuple({} for _ in range(WAITING_CLASSES))
        self._vtime = [0.0] * WAITING_CLASSES
        self._waiting = [0] * WAITING_CLASSES
        self._seq = count()
        self._flows: dict[int, list[float]] = {}  # flow -> [requests waiting, its weight]

    def __len__(self) -> int:
        return sum(self._waiting)

    def waiting(self, rank: int) -> int:
        return self._waiting[rank] if rank < WAITING_CLASSES else 0

    def waiting_at_or_above(self, rank: int) -> int:
        """Requests that go before one of class `rank`: its own class and higher."""
        return sum(self._waiting[: min(rank, WAITING_CLASSES - 1) + 1])

    def join(self, rank: int, flow: int, weight: float, turn: asyncio.Future[None]) -> Waiter:
        last = self._last_tag[rank]
        tag = max(self._vtime[rank], last.get(flow, 0.0)) + 1.0 / weight
        last[flow] = tag
        waiter = Waiter(tag, next(self._seq), rank, turn, flow)
        heapq.heappush(self._heaps[rank], waiter)
        self._waiting[rank] += 1
        entry = self._flows.setdefault(flow, [0, weight])
        entry[0] += 1
        entry[1] = weight
        return waiter

    def waiting_weight(self) -> float:
        """The weights of the flows with requests waiting here, summed: how much of the
        deployment's fair share this router's queue stands for (routing.leases)."""
        return sum(weight for _, weight in self._flows.values())

    def rejoin(self, waiter: Waiter, turn: asyncio.Future[None]) -> None:
        """Woken too early: back in with the same tag, so still ahead of later arrivals."""
        waiter.turn = turn
        heapq.heappush(self._heaps[waiter.rank], waiter)

    def leave(self, waiter: Waiter) -> None:
        """The waiter is done waiting (admitted, timed out or cancelled). Its heap entry,
        if still there, is skipped by `wake` (cancelled turn), not searched for."""
        if not waiter.turn.done():
            waiter.turn.cancel()
        self._waiting[waiter.rank] -= 1
        entry = self._flows[waiter.flow]
        entry[0] -= 1
        if not entry[0]:
            del self._flows[waiter.flow]
        if not self._waiting[waiter.rank]:  # nobody waits in the class: a fresh start
            self._heaps[waiter.rank].clear()
            self._last_tag[waiter.rank].clear()

    def wake(self) -> bool:
        """Give the turn to the first waiter in order; False when nobody waits."""
        for rank, heap in enumerate(self._heaps):
            while heap:
                waiter = heapq.heappop(heap)
                if waiter.turn.done():
                    continue  # it left; its entry was left here
                self._vtime[rank] = waiter.tag
                waiter.turn.set_result(None)
                return True
        return False
