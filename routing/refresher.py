"""Keeps a router's snapshot fresh and tells the control plane what the router has in flight.

All store access runs on one dedicated thread, never on the event loop, so a slow or dead
database delays the next refresh, not a single proxied request. When the store fails, the
router keeps serving from its last snapshot and /health says it is degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from routing.ports import RouterReport, SnapshotSource
from routing.router import RouterApp

log = logging.getLogger(__name__)
T = TypeVar("T")
LIFE_SIGN_SECONDS = 5.0
RECENT_WINDOW = 60.0
USAGE_FLUSH_SECONDS = 2.0
# Workers' reported queues are read this often between snapshot rebuilds: one light query.
LOAD_REPORTS_SECONDS = 1.0
# While no request comes, the refresher ticks this often instead of every poll_interval: an
# idle router then costs a quarter of the CPU, a change reaches it within this long, and the
# first request wakes it at once.
IDLE_POLL_SECONDS = 1.0


class SnapshotRefresher:
    def __init__(
        self,
        router: RouterApp,
        source: SnapshotSource,
        *,
        poll_interval: float = 0.25,
        idle_poll_interval: float = IDLE_POLL_SECONDS,
        max_age: float = 30.0,
        report_interval: float = 1.0,
    ) -> None:
        self.router = router
        self.source = source
        self.poll_interval = poll_interval
        self.idle_poll_interval = idle_poll_interval
        # A rebuild at least this often, as a safety net under the generation counter.
        self.max_age = max_age
        self.report_interval = report_interval
        self.instance_id = router.instance_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._task: asyncio.Task[None] | None = None
        self._last_report = 0.0
        self._last_reported: dict[int, int] | None = None
        self._last_traffic: dict[str, dict[str, Any]] = {}
        self._last_classes: dict[str, dict[str, list[int]]] = {}
        self._last_generation: int | None = None
        self._totals_history: deque[tuple[float, dict[int, tuple[int, int]]]] = deque()
        self._last_error_log = 0.0
        self._last_usage_flush = 0.0
        self._last_load_reports = 0.0

    async def start(self) -> None:
        await self.refresh_once()
        self._task = asyncio.create_task(self._loop(), name="snapshot-refresher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self._flush_usage(force=True)  # the last seconds of keyed traffic
            await self._run(self.source.forget, instance_id=self.instance_id)
        except Exception:
            log.debug("could not deregister router instance", exc_info=True)
        self._executor.shutdown(wait=False)

    async def _loop(self) -> None:
        while True:
            await self._pause()
            await self.refresh_once()
            if self.router.store is not None:
                await self.router.store.ping_if_due()  # how a Redis marked down comes back
            try:
                await self.router.readmit_due()
            except Exception:  # a probe must never stop the refresher
                log.exception("probing ejected workers failed")

    async def _pause(self) -> None:
        """poll_interval while requests flow; while none comes and nothing is in flight, on
        until idle_poll_interval, cut short by the first request."""
        seen = self.router.request_seen
        seen.clear()
        await asyncio.sleep(self.poll_interval)
        rest = self.idle_poll_interval - self.poll_interval
        if rest <= 0 or seen.is_set() or any(self.router.inflight.values()):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), rest)

    async def refresh_once(self) -> None:
        try:
            await self._refresh_snapshot()
            await self._refresh_loads()
            await self._report_inflight()
            await self._flush_usage()
        except Exception as exc:  # noqa: BLE001 - any store failure must leave us serving
            self.router.snapshot_error = f"{type(exc).__name__}: {exc}"
            self._log_error(exc)
        else:
            self.router.snapshot_error = None

    async def _refresh_snapshot(self) -> None:
        current = self.router.snapshot
        generation = await self._run(self.source.generation)
        now = time.time()
        stale = now >= current.valid_until or now - current.built_at >= self.max_age
        if generation != current.generation or stale:
            self.router.install(await self._run(self.source.load))

    async def _refresh_loads(self) -> None:
        """New queue reports every LOAD_REPORTS_SECONDS, then the fused loads recomputed
        (routing.peers.fleet_sync recomputes them more often when it runs)."""
        now = time.time()
        if now - self._last_load_reports >= LOAD_REPORTS_SECONDS:
            self._last_load_reports = now
            self.router.board.add_reports(await self._run(self.source.load_reports))
        self.router.board.refresh(now, (w.id for w in self.router.snapshot.workers))

    async def _report_inflight(self) -> None:
        """Report at once when the snapshot moved (a drain waits for exactly that), soon
        when in-flight counts changed, and every few seconds as a sign of life."""
        now = time.time()
        # Read together, with no await between: these counts belong to this snapshot.
        generation = self.router.snapshot.generation
        inflight = {k: v for k, v in self.router.inflight.items() if v}
        traffic = self.router.metrics.model_totals()
        classes = self.router.admission.class_counts()
        since = now - self._last_report
        moved = (
            inflight != self._last_reported
            or traffic != self._last_traffic
            or classes != self._last_classes
        )
        due = (
            generation != self._last_generation
            or self.router.passive_failures
            or self.router.ejector.events
            or (moved and since >= self.report_interval)
            or since >= LIFE_SIGN_SECONDS
        )
        if not due:
            return
        # Failed requests on real traffic go out with the next poll, so a dead worker leaves
        # the rotation within a second rather than at its next probe.
        failures = self.router.take_passive_failures()
        report = RouterReport(
            instance_id=self.instance_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.router.started_at,
            generation=generation,
            inflight=inflight,
            failures=failures,
            recent=self._recent_traffic(now),
            totals=self.router.metrics.worker_totals(),
            traffic=traffic,
            ejections=[(e.worker_id, e.kind, e.message) for e in self.router.ejector.take_events()],
            kv_events=self.router.kv_events.report(),
            classes=classes,
            fallbacks=[(*key, n) for key, n in self.router.metrics.fallbacks.items()],
        )
        self.router.exports_fleet_metrics = await self._run(self.source.report, report)
        self._last_report, self._last_reported, self._last_traffic = now, inflight, traffic
        self._last_classes = classes
        self._last_generation = generation

    async def _flush_usage(self, *, force: bool = False) -> None:
        """Write the keyed requests' usage every USAGE_FLUSH_SECONDS; what cannot be written
        goes back into the ledger for the next try."""
        ledger = self.router.gate.usage
        now = time.monotonic()
        if not ledger or (not force and now - self._last_usage_flush < USAGE_FLUSH_SECONDS):
            return
        batch = ledger.take()
        try:
            await self._run(self.source.record_usage, usage=batch)
        except BaseException:
            ledger.restore(batch)
            raise
        self._last_usage_flush = now

    def _recent_traffic(self, now: float) -> dict[int, tuple[int, int]]:
        """Requests and failures per worker over about the last RECENT_WINDOW seconds, from
        the router's running totals, so operators see a current error rate."""
        totals = self.router.metrics.worker_totals()
        self._totals_history.append((now, totals))
        while len(self._totals_history) > 1 and now - self._totals_history[0][0] > RECENT_WINDOW:
            self._totals_history.popleft()
        _, oldest = self._totals_history[0]
        recent: dict[int, tuple[int, int]] = {}
        for worker_id, (requests, errors) in totals.items():
            before = oldest.get(worker_id, (0, 0)) if len(self._totals_history) > 1 else (0, 0)
            recent[worker_id] = (requests - before[0], errors - before[1])
        return recent

    async def _run(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: func(*args, **kwargs))

    def _log_error(self, exc: Exception) -> None:
        now = time.time()
        if now - self._last_error_log > 30:
            log.error("snapshot refresh failed; serving the last snapshot: %s", exc)
            self._last_error_log = now
