"""Weighted random ("random"): a random worker, chosen in proportion to its weight.

A worker with weight 2 gets on average twice the requests of one with weight 1, whatever the
load; that suits a fleet of unequal GPUs whose relative capacity the operator knows. A weight
of 0 or less (or not finite) takes the worker out of the draw, unless no worker has a
positive weight: then all of them are drawn uniformly, because refusing every request over a
weight setting would be worse than ignoring it.

The cumulative weights are built once per snapshot (the router passes the same tuple object
until the next snapshot swap), so a decision is one random number and one binary search.

`rng` is a per-instance `random.Random`, so tests and simulations can seed it. No config
knobs: the config must be empty.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy, Explanation, RequestInfo
from routing.policies.load import no_config


class WeightedRandomPolicy(BasePolicy):
    name = "random"
    default_decision = "weighted"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        no_config(self.name, self.config)
        self.rng = random.Random()
        self._workers: Sequence[WorkerView] | None = None
        self._size = 0
        self._drawn: tuple[WorkerView, ...] = ()
        self._cumulative: tuple[float, ...] = ()
        self._total = 0.0

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        if workers is not self._workers or len(workers) != self._size:
            self._index(workers)
        drawn = self._drawn
        if len(drawn) <= 1:
            return drawn[0] if drawn else None
        i = bisect_right(self._cumulative, self.rng.random() * self._total)
        # random() < 1, but float rounding can land exactly on the total: clamp.
        return drawn[i if i < len(drawn) else -1]

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """Each worker's weight (its odds); the draw itself is random."""
        total = sum(w.weight for w in workers if w.weight > 0 and math.isfinite(w.weight))
        rows = [
            {"worker": w.name, "weight": w.weight,
             "share": round(w.weight / total, 3) if total and w.weight > 0 else 0.0,
             "load": loads.get(w.id, 0)}
            for w in sorted(workers, key=lambda w: -w.weight)
        ]  # fmt: skip
        return Explanation(self.default_decision, None, rows)

    def _index(self, workers: Sequence[WorkerView]) -> None:
        """Once per snapshot: the drawable workers and their running weight totals."""
        self._workers, self._size = workers, len(workers)
        drawn = [w for w in workers if w.weight > 0 and math.isfinite(w.weight)]
        if not drawn:
            drawn = list(workers)  # nobody weighted: uniform, rather than refusing
        weights = [w.weight if w.weight > 0 and math.isfinite(w.weight) else 1.0 for w in drawn]
        self._drawn, self._cumulative = tuple(drawn), tuple(accumulate(weights))
        self._total = self._cumulative[-1] if self._cumulative else 0.0
