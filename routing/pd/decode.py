"""The decode leg's worker: chosen by load, since its prompt's blocks arrive by transfer.

Among the model's decode-capable workers (roles `decode` and `both`), the one with the
least fused load (routing.fleet.load_signal: the requests every router has in flight on
it, corrected by the running and waiting sequences it reports), ties broken by the lower
KV cache usage as last scraped, then at random.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy, RequestInfo


class DecodeByLoad(BasePolicy):
    name = "pd_decode"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.rng = random.Random()

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        best: list[WorkerView] = []
        best_key = (0, 0.0)
        for worker in workers:
            key = (loads.get(worker.id, 0), worker.kv_cache_usage or 0.0)
            if not best or key < best_key:
                best, best_key = [worker], key
            elif key == best_key:
                best.append(worker)
        if not best:
            return None
        return best[0] if len(best) == 1 else self.rng.choice(best)
