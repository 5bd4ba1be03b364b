"""Each model's latest routing decisions, of this router and, through routing.peers.fleet_sync,
of its peers: what the models page and the admin API's recent decisions show.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

RING_SIZE = 50
_ENTRY_FIELDS = ("at", "worker", "decision", "attempts", "status", "explanation")


class DecisionRing:
    """Each model's last RING_SIZE decisions in this router process."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.size = size
        self.rings: dict[str, deque[tuple[Any, ...]]] = {}
        self.version = 0  # moves with every entry, so publishing can skip a quiet ring

    def add(
        self,
        model: str,
        worker: str | None,
        decision: str,
        attempts: int,
        status: int,
        explanation: Mapping[str, Any] | None,
    ) -> None:
        ring = self.rings.get(model)
        if ring is None:
            ring = self.rings[model] = deque(maxlen=self.size)
        # A tuple, not a dict: this runs for every request.
        ring.append((time.time(), worker, decision, attempts, status, explanation))
        self.version += 1

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {
            model: [dict(zip(_ENTRY_FIELDS, entry, strict=True)) for entry in ring]
            for model, ring in self.rings.items()
        }


def merged(
    rings: Sequence[Mapping[str, Sequence[Mapping[str, Any]]]], size: int = RING_SIZE
) -> dict[str, list[dict[str, Any]]]:
    """Several routers' rings as one: each model's latest `size` decisions, newest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for ring in rings:
        for model, entries in ring.items():
            out.setdefault(model, []).extend(dict(e) for e in entries)
    return {
        model: sorted(entries, key=lambda e: e["at"], reverse=True)[:size]
        for model, entries in out.items()
    }
