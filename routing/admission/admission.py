"""Admission control: in-flight limits per worker and per model, a bounded wait ordered by
priority class and fair between keys, and shedding.

Off unless a limit is set: CONTROLPANEL_MAX_INFLIGHT_PER_WORKER for every worker, and a
model's `max_inflight` (admin API) for that model. The limits are the deployment's: with
Redis, each router admits against the lease it holds on its share of each limit
(routing.admission.leases, renewed off the request path), so all routers together stay within it;
without Redis (or while Redis is down) each router process admits against the whole limit.

Every request carries a `Ticket`: its priority class (routing.fleet.priority), its flow (the
client key's id; 0 without keys), the flow's weight and its session (routing.sessions),
which orders the key's turns among its sessions. A request that finds no room:

* `critical` and `standard` wait in the model's routing.admission.fair_queue: critical ahead of
  standard, within a class the keys share the turns by weight, and each key's sessions
  share its turns equally. While anyone of its own class or higher waits, a newcomer
  queues behind them rather than overtake; a critical request passes waiting standard ones.
* `sheddable` is shed at once (429 with Retry-After): it never waits, so a flood of it
  cannot hold queue places that better requests need.

Headroom (a model's `priority_reserve`, r, default 0.2) keeps the last slots for better
classes, so a critical request need not wait for a running request to end:

* `sheddable` holds at most ``floor((1 - r) * slots)`` of the model's slots (at least one),
  always;
* `standard` leaves ``ceil(r * slots)`` slots to `critical` (but always keeps one) while
  critical traffic is recent for the model (one within CRITICAL_RECENT_S), or as many as
  critical requests ran at once here lately if that is more: with several routers each
  holds only its lease's share of the slots, and a reserve rounded from a small lease can be
  smaller than the critical traffic that lands on one router. With no critical traffic
  standard may use every slot, so a deployment that never sends critical requests loses
  nothing.

`slots` is what this router may run for the model now: the model's cap, and with a
per-worker limit the sum of its workers' caps (the leases' grants when shared).

A finished request wakes one waiter of each model its worker serves; the woken request
takes the room or keeps its place. A request that waited `queue_timeout` seconds, or found
`queue_max` requests waiting already, is answered 429 with Retry-After, and nothing was sent
to any worker, so the client may simply retry.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from routing.admission.fair_queue import FairQueue
from routing.admission.leases import Leases
from routing.fleet.priority import PRIORITIES, RANK, STANDARD
from routing.fleet.snapshot import WorkerView

Choose = Callable[[Sequence[WorkerView]], WorkerView | None]
CRITICAL_RECENT_S = 30.0
CRITICAL_RANK, STANDARD_RANK, SHEDDABLE_RANK = (RANK[p] for p in PRIORITIES)


@dataclass(slots=True)
class Ticket:
    """Who is asking: the class's rank (0: critical), the flow and its weight, and the
    session within the flow (routing.sessions; None: none). `refused` says why acquire
    answered None: "shed", "queue_full" or "queue_timeout"."""

    rank: int = RANK[STANDARD]
    flow: int = 0
    weight: float = 1.0
    reserve: float = 0.2  # the model's priority_reserve
    refused: str = ""
    session: str | None = None


def _counts() -> list[int]:
    return [0] * len(PRIORITIES)


class Admission:
    def __init__(
        self,
        per_worker: int = 0,
        queue_timeout: float = 10.0,
        queue_max: int = 1000,
        leases: Leases | None = None,
    ):
        self.per_worker = per_worker
        self.leases = leases or Leases()  # not shared: the whole limits, locally
        self.queue_timeout = queue_timeout
        self.queue_max = queue_max
        self.model_inflight: defaultdict[str, int] = defaultdict(int)
        self.queues: defaultdict[str, FairQueue] = defaultdict(FairQueue)
        self.rejected: defaultdict[str, int] = defaultdict(int)
        # Per model and class rank: running now, and ever admitted and shed (/metrics).
        self.class_inflight: defaultdict[str, list[int]] = defaultdict(_counts)
        self.admitted: defaultdict[str, list[int]] = defaultdict(_counts)
        self.shed: defaultdict[str, list[int]] = defaultdict(_counts)
        # Per model and class rank: requests that had to wait, and their waits' sum (s).
        self.waited: defaultdict[str, list[int]] = defaultdict(_counts)
        self.wait_seconds: defaultdict[str, list[float]] = defaultdict(lambda: [0.0] * 3)
        self._critical_seen: dict[str, float] = {}
        self._shed_since_ask: defaultdict[str, int] = defaultdict(int)
        # The most critical requests run at once lately, and when that was last reached.
        self._critical_peak: dict[str, tuple[int, float]] = {}

    def limits(self, model_limit: int | None) -> bool:
        return bool(self.per_worker or model_limit)

    async def acquire(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        choose: Choose,
        inflight: Mapping[int, int],
        ticket: Ticket | None = None,
    ) -> WorkerView | None:
        """A worker with room (counted in), or None when the request is refused (answer
        429; `ticket.refused` says why)."""
        ticket = ticket or Ticket()
        rank, queue = ticket.rank, self.queues[model]
        loop = asyncio.get_running_loop()
        if rank == CRITICAL_RANK:
            self._critical_seen[model] = loop.time()
        if not queue.waiting_at_or_above(rank):
            worker = self._room(model, workers, model_limit, choose, inflight, ticket)
            if worker is not None:
                return self._admitted(model, worker, rank)
        if rank == SHEDDABLE_RANK:
            return self._refused(model, ticket, "shed")
        if len(queue) >= self.queue_max:
            return self._refused(model, ticket, "queue_full")
        waited_from = loop.time()
        worker = await self._wait(model, workers, model_limit, choose, inflight, ticket)
        self.waited[model][rank] += 1
        self.wait_seconds[model][rank] += loop.time() - waited_from
        if worker is None:
            return self._refused(model, ticket, "queue_timeout")
        return self._admitted(model, worker, rank)

    async def _wait(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        choose: Choose,
        inflight: Mapping[int, int],
        ticket: Ticket,
    ) -> WorkerView | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout
        queue = self.queues[model]
        turn: asyncio.Future[None] = loop.create_future()
        waiter = queue.join(ticket.rank, ticket.flow, ticket.weight, turn, ticket.session)
        try:
            while True:
                try:
                    await asyncio.wait_for(turn, deadline - loop.time())
                except TimeoutError:
                    return None
                worker = self._room(model, workers, model_limit, choose, inflight, ticket)
                if worker is not None:
                    queue.admitted(waiter)
                    return worker
                turn = loop.create_future()
                queue.rejoin(waiter, turn)  # woken too early: keep the place at the head
        finally:
            queue.leave(waiter)
            self._wake(model)  # pass the turn on if room is left

    def _room(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        choose: Choose,
        inflight: Mapping[int, int],
        ticket: Ticket,
    ) -> WorkerView | None:
        leases, critical = self.leases, ticket.rank == CRITICAL_RANK
        model_cap = leases.model_cap(model, model_limit, critical) if model_limit else 0
        if model_limit and self.model_inflight[model] >= model_cap:
            return None
        worker_slots = 0
        if self.per_worker:
            limit, cap = self.per_worker, leases.worker_cap
            caps = [(w, cap(w.id, limit, critical)) for w in workers]
            workers = tuple(w for w, c in caps if inflight.get(w.id, 0) < c)
            worker_slots = sum(c for _, c in caps)
        if not workers:
            return None
        if ticket.rank != CRITICAL_RANK and ticket.reserve > 0:
            slots = min(model_cap or worker_slots, worker_slots or model_cap)
            if not self._class_may_take(model, ticket, slots):
                return None
        return choose(workers)

    def critical_recent(self, model: str) -> bool:
        seen = self._critical_seen.get(model)
        return seen is not None and asyncio.get_running_loop().time() - seen <= CRITICAL_RECENT_S

    def _class_may_take(self, model: str, ticket: Ticket, slots: int) -> bool:
        """The headroom rule (module docstring) for a standard or sheddable request."""
        running = self.class_inflight[model]
        sheddable_cap = max(1, math.floor((1 - ticket.reserve) * slots))
        if ticket.rank == SHEDDABLE_RANK and running[SHEDDABLE_RANK] >= sheddable_cap:
            return False
        if not self.critical_recent(model):
            return True
        below_critical = running[STANDARD_RANK] + running[SHEDDABLE_RANK]
        return below_critical < slots - self.critical_headroom(model, ticket.reserve, slots)

    def room(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        inflight: Mapping[int, int],
    ) -> dict[int, bool]:
        """Which of `workers` could take a request now (for routing.telemetry.explain);
        read-only."""
        leases = self.leases
        if model_limit and self.model_inflight[model] >= leases.model_cap(model, model_limit):
            return {w.id: False for w in workers}
        if not self.per_worker:
            return {w.id: True for w in workers}
        limit, cap = self.per_worker, leases.worker_cap
        return {w.id: inflight.get(w.id, 0) < cap(w.id, limit) for w in workers}

    def _admitted(self, model: str, worker: WorkerView, rank: int) -> WorkerView:
        self.model_inflight[model] += 1
        self.class_inflight[model][rank] += 1
        self.admitted[model][rank] += 1
        if rank == CRITICAL_RANK:
            self._note_critical_peak(model, self.class_inflight[model][rank])
        return worker

    def _note_critical_peak(self, model: str, running: int) -> None:
        now = asyncio.get_running_loop().time()
        peak, at = self._critical_peak.get(model, (0, now))
        if running >= peak or now - at > CRITICAL_RECENT_S:
            self._critical_peak[model] = (running, now)

    def critical_claim(
        self, model: str, reserve: float, workers: Sequence[WorkerView], model_limit: int
    ) -> int:
        """The slots critical requests want here now (0 without recent critical traffic):
        the headroom standard and sheddable ones leave them, before it is capped to leave
        one slot to the rest. What this router's leases are due before the keys' weights
        split the rest (routing.admission.leases); uncapped, or a small lease would claim too little
        to grow out of."""
        if not self.critical_recent(model):
            return 0
        leases, slots = self.leases, 0
        if self.per_worker:
            slots = sum(leases.worker_cap(w.id, self.per_worker) for w in workers)
        if model_limit:
            model_cap = leases.model_cap(model, model_limit)
            slots = min(slots, model_cap) if self.per_worker else model_cap
        return self._critical_wanted(model, reserve, slots)

    def critical_headroom(self, model: str, reserve: float, slots: int) -> int:
        """The slots standard requests leave to critical ones while those are recent: the
        reserve's share, or as many as critical requests lately ran at once if more."""
        return min(self._critical_wanted(model, reserve, slots), slots - 1)

    def _critical_wanted(self, model: str, reserve: float, slots: int) -> int:
        peak, at = self._critical_peak.get(model, (0, 0.0))
        if asyncio.get_running_loop().time() - at > CRITICAL_RECENT_S:
            peak = 0
        return max(math.ceil(reserve * slots), peak)

    def _refused(self, model: str, ticket: Ticket, why: str) -> WorkerView | None:
        ticket.refused = why
        self.rejected[model] += 1
        if why == "shed":
            self.shed[model][ticket.rank] += 1
            self._shed_since_ask[model] += 1
        return None

    def release(self, model: str, served_by: Iterable[str], rank: int = STANDARD_RANK) -> None:
        """A request of class `rank` admitted for `model` finished on a worker serving
        `served_by`."""
        self.model_inflight[model] -= 1
        self.class_inflight[model][rank] -= 1
        self._wake(model)
        for other in served_by:
            if other != model:
                self._wake(other)

    def wake(self, models: Iterable[str]) -> None:
        """Room appeared that no release announced (a lease grew): the heads try again."""
        for model in models:
            self._wake(model)

    def _wake(self, model: str) -> None:
        queue = self.queues.get(model)
        if queue:
            queue.wake()

    def queued(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self.queues.items() if queue}

    def class_counts(self) -> dict[str, dict[str, list[int]]]:
        """Per model: requests waiting now, and ever admitted and shed, per class rank (the
        routers' report, for the models page)."""
        models = set(self.admitted) | set(self.shed) | {m for m, q in self.queues.items() if q}
        return {
            model: {
                "queued": [self.queues[model].waiting(r) for r in range(len(PRIORITIES))],
                "admitted": list(self.admitted[model]),
                "shed": list(self.shed[model]),
            }
            for model in models
        }

    def wanted(self) -> dict[str, int]:
        """Per model, the requests that wanted room since the last call: those waiting, and
        those shed meanwhile (which never wait, so would otherwise never show as demand: a
        router whose lease had no room for them could never ask for more)."""
        wanted = self.queued()
        for model, shed in self._shed_since_ask.items():
            wanted[model] = wanted.get(model, 0) + shed
        self._shed_since_ask.clear()
        return wanted

    def queued_by_class(self) -> dict[tuple[str, str], int]:
        """(model, class) -> requests waiting, for /metrics."""
        return {
            (model, PRIORITIES[rank]): queue.waiting(rank)
            for model, queue in self.queues.items()
            for rank in (CRITICAL_RANK, STANDARD_RANK)
            if queue.waiting(rank)
        }


def refusal_message(ticket: Ticket, model: str) -> str:
    """The 429's message for a request admission turned away."""
    if ticket.refused == "shed":
        return (
            f"`{model}` is at capacity and `sheddable` requests are shed first; retry shortly "
            "(see Retry-After) or send this request at a higher priority class"
        )
    return f"too many requests in flight for `{model}`; retry shortly"
