"""Power of two choices: draw two distinct workers at random, send to the less loaded.

Load is routing.policies.load's fused signal, the same in every router. Comparing just two
random workers costs O(1) whatever the fleet's size, yet keeps the maximum load
exponentially closer to the mean than a purely random choice does; and because the
candidates are random, several routers working from loads a little out of step do not all
pile onto the one worker that looked emptiest, as a global shortest-queue choice can. On a
tie either candidate may win (the first drawn, itself random). With one worker it is
returned; with none, None.

`rng` is a per-instance `random.Random`, so tests and simulations can seed it. No config
knobs: the config must be empty.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy, Explanation, RequestInfo
from routing.policies.load import load_of, no_config


class PowerOfTwoPolicy(BasePolicy):
    name = "power_of_two"
    default_decision = "two_choices"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        no_config(self.name, self.config)
        self.rng = random.Random()

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        n = len(workers)
        if n <= 1:
            return workers[0] if n else None
        draw = self.rng.random  # int(random() * n) < n for any n < 2**53; randrange is slower
        i = int(draw() * n)
        j = int(draw() * (n - 1))  # one of the other n-1: skip over i
        first, second = workers[i], workers[j + 1 if j >= i else j]
        return second if load_of(second, loads) < load_of(first, loads) else first

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        """The loads the two random candidates are compared by; the pair itself is drawn
        at random, so which worker is not known in advance."""
        told = super().explain(workers, request, loads)
        return Explanation(self.default_decision, None, told.candidates)
