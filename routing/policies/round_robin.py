"""Round robin: each worker in turn, in ascending worker-id order, ignoring load.

The policy remembers the id of the worker it picked last and takes the next larger id among
the workers it is given now (wrapping to the smallest). Remembering an id rather than a
position keeps the rotation fair when the worker list changes between calls: a worker that
joins slots into the cycle where its id falls, one that leaves (drained, unhealthy) is simply
skipped, and nobody is picked twice or passed over because positions shifted.

The id-ordered list is built once per snapshot (the router passes the same tuple object until
the next snapshot swap), so a decision is one binary search: O(log n), no allocation.

Each router process keeps its own rotation. No config knobs: the config must be empty.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy, Explanation, RequestInfo
from routing.policies.load import no_config


class RoundRobinPolicy(BasePolicy):
    name = "round_robin"
    default_decision = "turn"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        no_config(self.name, self.config)
        self._workers: Sequence[WorkerView] | None = None
        self._size = 0
        self._ordered: tuple[WorkerView, ...] = ()
        self._ids: tuple[int, ...] = ()
        self._last_id: int | None = None

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        if not self._ordered:
            return None
        i = 0 if self._last_id is None else bisect_right(self._ids, self._last_id)
        worker = self._ordered[i if i < len(self._ordered) else 0]
        self._last_id = worker.id
        return worker

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """Whose turn it is, and the order after it (loads shown, not used)."""
        ordered = sorted(workers, key=lambda w: w.id)
        if not ordered:
            return Explanation(self.default_decision, None, [])
        last = self._last_id
        i = 0 if last is None else bisect_right([w.id for w in ordered], last) % len(ordered)
        turns = ordered[i:] + ordered[:i]
        rows = [
            {"worker": w.name, "turn": n, "load": loads.get(w.id, 0)} for n, w in enumerate(turns)
        ]
        return Explanation(self.default_decision, turns[0], rows)

    def _index(self, workers: Sequence[WorkerView]) -> None:
        """Once per snapshot: the workers by id, for the binary search."""
        self._workers, self._size = workers, len(workers)
        self._ordered = tuple(sorted(workers, key=lambda w: w.id))
        self._ids = tuple(w.id for w in self._ordered)
