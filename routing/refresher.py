"""Keeps a router's snapshot fresh and tells the control plane what the router has in flight.

All store access runs on one dedicated thread, never on the event loop, so a slow or dead
database delays the next refresh, not a single proxied request. When the store fails, the
router keeps serving from its last snapshot and /health says it is degraded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar
from collections.abc import Callable

from routing.proxy import RouterApp
from routing.snapshot import Snapshot

log = logging.getLogger(__name__)
T = TypeVar("T")


class SnapshotSource(Protocol):
    def generation(self) -> int: ...

    def load(self) -> Snapshot: ...

    def report(
        self,
        *,
        instance_id: str,
        hostname: str,
        pid: int,
        started_at: float,
        inflight: dict[int, int],
    ) -> None: ...

    def forget(self, *, instance_id: str) -> None: ...


class SnapshotRefresher:
    def __init__(
        self,
        router: RouterApp,
        source: SnapshotSource,
        *,
        poll_interval: float = 0.25,
        max_age: float = 1.0,
        report_interval: float = 1.0,
    ) -> None:
        self.router = router
        self.source = source
        self.poll_interval = poll_interval
        # Rebuild at least this often even with no change: heartbeat expiry is a matter of
        # time passing, which no write announces.
        self.max_age = max_age
        self.report_interval = report_interval
        self.instance_id = uuid.uuid4().hex
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._task: asyncio.Task[None] | None = None
        self._last_report = 0.0
        self._last_reported: dict[int, int] | None = None
        self._last_error_log = 0.0

    async def start(self) -> None:
        await self.refresh_once()
        self._task = asyncio.create_task(self._loop(), name="snapshot-refresher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await self._run(self.source.forget, instance_id=self.instance_id)
        except Exception:  # noqa: BLE001 - shutting down; the row expires by itself
            log.debug("could not deregister router instance", exc_info=True)
        self._executor.shutdown(wait=False)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            await self.refresh_once()

    async def refresh_once(self) -> None:
        try:
            await self._refresh_snapshot()
            await self._report_inflight()
        except Exception as exc:  # noqa: BLE001 - any store failure must leave us serving
            self.router.snapshot_error = f"{type(exc).__name__}: {exc}"
            self._log_error(exc)
        else:
            self.router.snapshot_error = None

    async def _refresh_snapshot(self) -> None:
        current = self.router.snapshot
        generation = await self._run(self.source.generation)
        if generation != current.generation or time.time() - current.built_at >= self.max_age:
            self.router.snapshot = await self._run(self.source.load)

    async def _report_inflight(self) -> None:
        now = time.time()
        inflight = {k: v for k, v in self.router.inflight.items() if v}
        changed = inflight != self._last_reported
        due = now - self._last_report >= (self.report_interval if changed else 5.0)
        if not due:
            return
        await self._run(
            self.source.report,
            instance_id=self.instance_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.router.started_at,
            inflight=inflight,
        )
        self._last_report, self._last_reported = now, inflight

    async def _run(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: func(*args, **kwargs))

    def _log_error(self, exc: Exception) -> None:
        now = time.time()
        if now - self._last_error_log > 30:
            log.error("snapshot refresh failed; serving the last snapshot: %s", exc)
            self._last_error_log = now
