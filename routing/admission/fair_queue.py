"""The waiting room of one model: by priority class first, then fair between keys, then fair
between each key's sessions.

routing.admission.admission parks a request here when no worker has room for it. When room appears
the queue wakes one waiter: the head of the highest class that has any (`critical`, then
`standard`; `sheddable` requests never wait, they are shed). Within a class the turn is
shared in two levels, each self-clocked fair queuing (SCFQ, Golestani 1994):

* **Between keys, by weight.** Each waiting request adds a turn to its key (its flow: the
  client key's id, 0 without keys) tagged ``max(virtual time, the key's last tag) +
  1 / weight``; the key with the smallest tag has the next turn, and the virtual time moves
  to a tag only when its request is *admitted*. So while two keys both have requests
  waiting they get turns in the ratio of their weights (a weight-3 key three for each of a
  weight-1 key's) however many requests either queues: a flood only lengthens its own line.
  A key that was idle starts at the virtual time: it cannot bank turns while it sends
  nothing, nor be punished for what it sent long ago.
* **Within a key, between its sessions, equally.** The key's turn goes to one of its
  sessions (routing.sessions: an agent's session header, or the OpenAI `user`; a request
  without one is the key's "no session" line) by the same rule with weight 1 each, so two
  agents behind one key share the key's turns equally, whichever sends faster.

Why sessions split their key's weight rather than each taking the whole of it: the key is
what a platform team hands out and weighs (one per team or product); if every session
counted as a flow of the key's weight, a key could multiply its share by opening sessions,
and the weights operators set would mean nothing under load. llm-d's flow control reads
the same agent headers as fairness ids, one level deep with no weights; here the key's
weight stays the contract between keys and the fairness id orders turns inside it. Without
client keys every request is key 0, so sessions are simply the flows and share equally.

A woken waiter that still finds no room (another router took the slot, or its class may
not use it) goes back with its own tags, so it keeps its place at the head. Waking it did
not move the virtual time: only an admission does. (It used to move on every wake, and
admission wakes the next head after each admission to pass on room that is left; that
head, usually the weight-1 key's with a tag far ahead, set the virtual time, and the
weight-3 key's next request was tagged behind it: two keys of weights 3 and 1 with equal
closed loops got 0.67 and 0.33 of a saturated pool instead of 0.75 and 0.25.)

Memory is bounded by what waits: a key's sessions are forgotten when the key has no request
waiting in the class, keys' last tags when nobody waits in the class (a fresh start).
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import count

WAITING_CLASSES = 2  # ranks 0 (critical) and 1 (standard); sheddable is never queued
# A waiter's state: holding one of its key's turns, woken (its turn taken), or gone.
WAITING, WOKEN, GONE = 0, 1, 2


@dataclass(order=True, slots=True)
class Waiter:
    tag: float  # its session's tag within its key (the order inside the key)
    seq: int
    rank: int = field(compare=False)
    turn: asyncio.Future[None] = field(compare=False)
    flow: int = field(compare=False, default=0)
    session: str | None = field(compare=False, default=None)
    key_tag: float = field(compare=False, default=0.0)  # the key's turn it was woken with
    state: int = field(compare=False, default=WAITING)


@dataclass(slots=True, eq=False)
class _Key:
    """One key's waiting requests in one class: its turns' tags (sorted: each new one is
    the largest, a woken waiter's returns to the front), its own entry in the class's heap,
    and the sessions' fair queue inside it."""

    tags: deque[float] = field(default_factory=deque)
    entry: int = -1  # the seq of its live entry in the class's heap
    vtime: float = 0.0  # the sessions' virtual time
    last: dict[str | None, float] = field(default_factory=dict)  # session -> last tag
    waiters: list[Waiter] = field(default_factory=list)  # heap by session tag
    members: int = 0  # its waiters that have not left (woken ones may come back)


class FairQueue:
    def __init__(self) -> None:
        # Per class: (the key's first tag, seq, flow), one live entry per key with waiters.
        self._heaps: tuple[list[tuple[float, int, int]], ...] = tuple(
            [] for _ in range(WAITING_CLASSES)
        )
        self._keys: tuple[dict[int, _Key], ...] = tuple({} for _ in range(WAITING_CLASSES))
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

    def join(
        self,
        rank: int,
        flow: int,
        weight: float,
        turn: asyncio.Future[None],
        session: str | None = None,
    ) -> Waiter:
        last = self._last_tag[rank]
        key_tag = max(self._vtime[rank], last.get(flow, 0.0)) + 1.0 / weight
        last[flow] = key_tag
        key = self._keys[rank].get(flow)
        if key is None:
            key = self._keys[rank][flow] = _Key()
        key.tags.append(key_tag)
        if len(key.tags) == 1:
            self._push_entry(rank, flow, key)
        tag = max(key.vtime, key.last.get(session, 0.0)) + 1.0
        key.last[session] = tag
        waiter = Waiter(tag, next(self._seq), rank, turn, flow, session)
        heapq.heappush(key.waiters, waiter)
        key.members += 1
        self._waiting[rank] += 1
        entry = self._flows.setdefault(flow, [0, weight])
        entry[0] += 1
        entry[1] = weight
        return waiter

    def waiting_weight(self) -> float:
        """The weights of the flows with requests waiting here, summed: how much of the
        deployment's fair share this router's queue stands for (routing.admission.leases)."""
        return sum(weight for _, weight in self._flows.values())

    def rejoin(self, waiter: Waiter, turn: asyncio.Future[None]) -> None:
        """Woken too early: back in with the same tags, so still ahead of later arrivals."""
        waiter.turn, waiter.state = turn, WAITING
        key = self._keys[waiter.rank][waiter.flow]  # it still counts as waiting: kept
        key.tags.appendleft(waiter.key_tag)
        # Its own arrival order breaks a tie of tags, not the moment it came back.
        self._push_entry(waiter.rank, waiter.flow, key, waiter.seq)
        heapq.heappush(key.waiters, waiter)

    def admitted(self, waiter: Waiter) -> None:
        """The woken waiter took the room: only now do the virtual times move."""
        rank = waiter.rank
        self._vtime[rank] = max(self._vtime[rank], waiter.key_tag)
        key = self._keys[rank].get(waiter.flow)
        if key is not None:
            key.vtime = max(key.vtime, waiter.tag)

    def leave(self, waiter: Waiter) -> None:
        """The waiter is done waiting (admitted, timed out or cancelled). Its heap entry,
        if still there, is skipped by `wake` (gone), not searched for."""
        rank = waiter.rank
        if not waiter.turn.done():
            waiter.turn.cancel()
        keys = self._keys[rank]
        key = keys[waiter.flow]
        if waiter.state == WAITING:  # its key gives up a turn: the latest, so the others
            _give_up_turn(key)  # keep their places
        waiter.state = GONE
        self._waiting[rank] -= 1
        entry = self._flows[waiter.flow]
        entry[0] -= 1
        if not entry[0]:
            del self._flows[waiter.flow]
        key.members -= 1
        if not key.members:
            del keys[waiter.flow]  # nothing of the key waits: its sessions are forgotten
        if not self._waiting[rank]:  # nobody waits in the class: a fresh start
            self._heaps[rank].clear()
            keys.clear()
            self._last_tag[rank].clear()

    def wake(self) -> bool:
        """Give the turn to the first waiter in order; False when nobody waits."""
        for rank, heap in enumerate(self._heaps):
            keys = self._keys[rank]
            while heap:
                _, seq, flow = heapq.heappop(heap)
                key = keys.get(flow)
                if key is None or key.entry != seq:
                    continue  # stale: the key's first tag changed, or it left
                key.entry = -1
                waiter = _first_waiting(key)
                if waiter is None:
                    continue
                waiter.key_tag = key.tags.popleft()
                waiter.state = WOKEN
                if key.tags:
                    self._push_entry(rank, flow, key)
                waiter.turn.set_result(None)
                return True
        return False

    def _push_entry(self, rank: int, flow: int, key: _Key, seq: int | None = None) -> None:
        key.entry = seq = next(self._seq) if seq is None else seq
        heapq.heappush(self._heaps[rank], (key.tags[0], seq, flow))


def _first_waiting(key: _Key) -> Waiter | None:
    """Pop the key's first waiter by session tag, skipping those gone. One whose wait was
    cancelled (timed out, client gone) but that has not left yet gives up its key's turn
    here, as leave would; None when no waiter of the key can take a turn."""
    waiters = key.waiters
    while waiters:
        waiter = heapq.heappop(waiters)
        if waiter.state != WAITING:
            continue
        if not waiter.turn.done():
            return waiter
        waiter.state = GONE
        _give_up_turn(key)
    return None


def _give_up_turn(key: _Key) -> None:
    key.tags.pop()
    if not key.tags:
        key.entry = -1
