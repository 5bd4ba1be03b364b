"""Admission control: in-flight limits per worker and per model, with a bounded FIFO wait.

Off unless a limit is set: CONTROLPANEL_MAX_INFLIGHT_PER_WORKER for every worker, and a
model's `max_inflight` (admin API) for that model. Limits count this router process's own
requests (like the policies' in-flight counts), so with R replicas a worker may see up to
R times the limit.

A request that finds no room waits in its model's queue, first come first served: while
anyone waits, newcomers queue behind them rather than overtake. A finished request wakes
the head of the queue of each model its worker serves; the head takes the room or waits on
at the head. A request that waited `queue_timeout` seconds, or found the queue holding
`queue_max` requests already, is answered 429 with Retry-After, and nothing was sent to any
worker, so the client may simply retry.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from routing.snapshot import WorkerView

Choose = Callable[[Sequence[WorkerView]], WorkerView | None]


class Admission:
    def __init__(self, per_worker: int = 0, queue_timeout: float = 10.0, queue_max: int = 1000):
        self.per_worker = per_worker
        self.queue_timeout = queue_timeout
        self.queue_max = queue_max
        self.model_inflight: defaultdict[str, int] = defaultdict(int)
        self.queues: defaultdict[str, deque[asyncio.Future[None]]] = defaultdict(deque)
        self.rejected: defaultdict[str, int] = defaultdict(int)

    def limits(self, model_limit: int | None) -> bool:
        return bool(self.per_worker or model_limit)

    async def acquire(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        choose: Choose,
        inflight: Mapping[int, int],
    ) -> WorkerView | None:
        """A worker with room (counted in), or None when the wait failed (answer 429)."""
        queue = self.queues[model]
        if not queue:
            worker = self._room(model, workers, model_limit, choose, inflight)
            if worker is not None:
                return self._admitted(model, worker)
        if len(queue) >= self.queue_max:
            self.rejected[model] += 1
            return None
        worker = await self._wait(model, workers, model_limit, choose, inflight)
        if worker is None:
            self.rejected[model] += 1
            return None
        return self._admitted(model, worker)

    async def _wait(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        choose: Choose,
        inflight: Mapping[int, int],
    ) -> WorkerView | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout
        queue = self.queues[model]
        turn: asyncio.Future[None] = loop.create_future()
        queue.append(turn)
        try:
            while True:
                try:
                    await asyncio.wait_for(turn, deadline - loop.time())
                except TimeoutError:
                    return None
                worker = self._room(model, workers, model_limit, choose, inflight)
                if worker is not None:
                    return worker
                turn = loop.create_future()
                queue.appendleft(turn)  # woken too early: keep the place at the head
        finally:
            if turn in queue:
                queue.remove(turn)
            self._wake(model)  # pass the turn on if room is left

    def _room(
        self,
        model: str,
        workers: Sequence[WorkerView],
        model_limit: int | None,
        choose: Choose,
        inflight: Mapping[int, int],
    ) -> WorkerView | None:
        if model_limit and self.model_inflight[model] >= model_limit:
            return None
        if self.per_worker:
            limit = self.per_worker
            workers = tuple(w for w in workers if inflight.get(w.id, 0) < limit)
        return choose(workers) if workers else None

    def _admitted(self, model: str, worker: WorkerView) -> WorkerView:
        self.model_inflight[model] += 1
        return worker

    def release(self, model: str, served_by: Iterable[str]) -> None:
        """A request admitted for `model` finished on a worker serving `served_by`."""
        self.model_inflight[model] -= 1
        self._wake(model)
        for other in served_by:
            if other != model:
                self._wake(other)

    def _wake(self, model: str) -> None:
        queue = self.queues.get(model)
        while queue:
            head = queue[0]
            if not head.done():
                head.set_result(None)
                return
            queue.popleft()

    def queued(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self.queues.items() if queue}
