"""Outlier ejection: a worker that keeps failing real traffic leaves this router's rotation
at once, without waiting for the control plane's health checks.

After `threshold` consecutive failures (connection refused or reset, connect timeout, a 5xx
answer, a stream that broke) the worker is ejected for a cool-down: `base_cooldown`
seconds the first time, doubled on each ejection that follows soon after (capped at
`max_cooldown`); a worker that stays good for `forgive_after` seconds starts from the base
again. When the cool-down is over the router probes the worker's /health itself; a good
answer readmits it, a bad one ejects it again with the next, longer cool-down. A worker the
control plane took out (unhealthy) and put back after its own probes is readmitted at once.
While every worker of a model is ejected none is excluded (a router that refused all
traffic would turn a partial outage into a total one).

Ejections and readmissions are queued as events for the control plane's log (the refresher
reports them) and counted on /metrics. With several routers they are also queued in
`to_share` for routing.peers.fleet_sync, which tells every other router; those apply them with
`eject_shared` and `readmit_shared`, which record no event of their own (the router that
decided reports it) and share nothing back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from routing.fleet.snapshot import WorkerView


@dataclass(frozen=True, slots=True)
class EjectionEvent:
    worker_id: int
    kind: str  # "ejected" or "readmitted"
    message: str


class Ejector:
    def __init__(
        self,
        threshold: int = 5,
        base_cooldown: float = 5.0,
        max_cooldown: float = 300.0,
        forgive_after: float = 600.0,
    ) -> None:
        self.threshold = threshold
        self.base_cooldown = base_cooldown
        self.max_cooldown = max_cooldown
        self.forgive_after = forgive_after
        self.failures: dict[int, int] = {}
        self.ejected_until: dict[int, float] = {}
        self.ejections: dict[int, int] = {}  # how many times, recently, for the back-off
        self.ejections_total: dict[int, int] = {}
        self.last_ejected: dict[int, float] = {}
        self.events: list[EjectionEvent] = []
        # (worker id, "ejected" with the seconds left, or "readmitted" with 0, why).
        self.to_share: list[tuple[int, str, float, str]] = []

    def failure(self, worker_id: int, cause: str, now: float | None = None) -> None:
        if self.threshold <= 0 or worker_id in self.ejected_until:
            return
        count = self.failures.get(worker_id, 0) + 1
        self.failures[worker_id] = count
        if count >= self.threshold:
            self._eject(worker_id, f"{count} failures in a row, the last: {cause}", now)

    def success(self, worker_id: int) -> None:
        if self.failures.get(worker_id):
            self.failures[worker_id] = 0

    def _eject(self, worker_id: int, why: str, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.last_ejected.get(worker_id, -1e18) > self.forgive_after:
            self.ejections[worker_id] = 0
        times = self.ejections[worker_id] = self.ejections.get(worker_id, 0) + 1
        cooldown = min(self.max_cooldown, self.base_cooldown * 2 ** (times - 1))
        self.ejected_until[worker_id] = now + cooldown
        self.last_ejected[worker_id] = now
        self.ejections_total[worker_id] = self.ejections_total.get(worker_id, 0) + 1
        self.failures[worker_id] = 0
        message = f"{why}; out of rotation for {cooldown:g} s"
        self.events.append(EjectionEvent(worker_id, "ejected", message))
        self.to_share.append((worker_id, "ejected", cooldown, message))

    def routable(self, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        """The workers not ejected now (all of them when every one is)."""
        if not self.ejected_until:
            return workers
        kept = tuple(w for w in workers if w.id not in self.ejected_until)
        return kept or workers

    def due_for_probe(self, now: float | None = None) -> list[int]:
        now = time.monotonic() if now is None else now
        return [wid for wid, until in self.ejected_until.items() if until <= now]

    def probed(self, worker_id: int, healthy: bool, detail: str, now: float | None = None) -> None:
        if worker_id not in self.ejected_until:
            return
        del self.ejected_until[worker_id]
        if healthy:
            self.events.append(EjectionEvent(worker_id, "readmitted", f"probe answered: {detail}"))
            self.to_share.append((worker_id, "readmitted", 0.0, detail))
        else:
            self._eject(worker_id, f"probe after the cool-down failed: {detail}", now)

    def readmit_recovered(self, recovered: set[int]) -> None:
        """The control plane's own probes found these workers healthy again."""
        for worker_id in recovered & set(self.ejected_until):
            del self.ejected_until[worker_id]
            self.failures[worker_id] = 0
            self.events.append(
                EjectionEvent(
                    worker_id, "readmitted", "the control plane's probes found it healthy"
                )
            )

    def forget(self, live_ids: set[int]) -> None:
        """Drop the state of workers that left the fleet."""
        for table in (self.failures, self.ejected_until):
            for wid in [w for w in table if w not in live_ids]:
                del table[wid]

    def eject_shared(self, worker_id: int, seconds: float, now: float | None = None) -> None:
        """Another router ejected the worker for `seconds` more: out of rotation here too,
        probed here when that is over (each router readmits by its own probe, or the
        deciding router's readmission reaches it first)."""
        now = time.monotonic() if now is None else now
        self.ejected_until[worker_id] = max(self.ejected_until.get(worker_id, 0.0), now + seconds)
        self.failures[worker_id] = 0

    def readmit_shared(self, worker_id: int) -> None:
        """Another router's probe found the worker healthy again."""
        self.ejected_until.pop(worker_id, None)
        self.failures[worker_id] = 0

    def take_shared(self) -> list[tuple[int, str, float, str]]:
        taken, self.to_share = self.to_share, []
        return taken

    def take_events(self) -> list[EjectionEvent]:
        taken, self.events = self.events, []
        return taken
