"""The live feed behind the dashboard: the web process itself notices changes and pushes
re-rendered rows to its open pages.

Why the web process and not Celery: with the embedded in-memory channel layer a message
sent from the Celery process never reaches the web process, and with Redis a per-process
producer still works the same way, so one mechanism serves both. Every PUBLISH_INTERVAL
the publisher reads the fleet (off the event loop), compares each row's change key with
what it last sent, and sends only the rows that changed, rendered by the same partial
templates as the first page load. Each process has its own group, so a page never gets a
row twice when several web processes share a Redis channel layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections

from controlpanel.console import dashboard, event_log, problems, rollout_dashboard

log = logging.getLogger(__name__)

GROUP = f"fleet-{os.getpid()}-{uuid.uuid4().hex[:8]}"
NUDGE_GROUP = "fleet-nudges"
PUBLISH_INTERVAL = 0.4
STOP_SECONDS = 2.0  # how long stop() waits for its tasks
NUDGE_RETRY_SECONDS = 5.0


def nudge_dashboards() -> None:
    """Tell every web process's publisher that something changed. Over Redis this reaches
    them from any process, Celery included. The in-memory layer cannot carry it across
    processes (nor safely across threads), so there the publishers' own polling serves."""
    layer = get_channel_layer()
    if layer is None or not settings.REDIS_URL:
        return
    try:
        async_to_sync(layer.group_send)(NUDGE_GROUP, {"type": "fleet.nudge"})
    except Exception:
        log.warning("could not nudge the dashboards", exc_info=True)


def nudge_on_commit(sender: Any, **kwargs: Any) -> None:
    """The receiver of registry.signals.routing_committed (connected in console.apps)."""
    nudge_dashboards()


class LivePublisher:
    def __init__(self, interval: float = PUBLISH_INTERVAL) -> None:
        self.interval = interval
        self._subscribers = 0
        self._watched = asyncio.Event()  # set while a dashboard is open here
        self._sent_keys: dict[int, tuple[Any, ...]] = {}
        self._sent_totals = ""
        self._sent_problems = ""
        self._sent_plans: dict[int, tuple[Any, ...]] = {}
        self._sent_event = 0
        self._nudged = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def subscribers(self) -> int:
        """Open dashboards on this process (the consumer counts them in and out)."""
        return self._subscribers

    @subscribers.setter
    def subscribers(self, count: int) -> None:
        self._subscribers = count
        if count > 0:
            self._watched.set()
        else:
            self._watched.clear()

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="live")
        self._nudged = asyncio.Event()
        self._watched = asyncio.Event()
        if self._subscribers > 0:
            self._watched.set()
        self._tasks = [
            asyncio.create_task(self._loop(), name="live-publisher"),
            asyncio.create_task(self._listen_for_nudges(), name="live-nudges"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Bounded: a channel-layer call stuck on a slow Redis must not hold the router's
        # shutdown past its grace (the supervisor would kill it, open streams and all).
        done, pending = (
            await asyncio.wait(self._tasks, timeout=STOP_SECONDS) if self._tasks else (set(), set())
        )
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.warning(
                    "live feed task %s had failed", task.get_name(), exc_info=task.exception()
                )
        for task in pending:
            log.warning("live feed task %s still stopping; left behind", task.get_name())
        self._executor.shutdown(wait=False)

    async def _listen_for_nudges(self) -> None:
        """A change committed anywhere (Celery over Redis included) nudges every web
        process, which then publishes at once instead of at its next tick. While Redis is
        unreachable the publisher's polling serves alone, and this retries every
        NUDGE_RETRY_SECONDS, so nudges resume by themselves."""
        layer = get_channel_layer()
        if layer is None:
            return
        failing = False
        while True:
            try:
                channel = await layer.new_channel()
                while True:
                    # Group membership expires in channels_redis; joining again is cheap.
                    await layer.group_add(NUDGE_GROUP, channel)
                    failing = False
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(layer.receive(channel), timeout=600)
                        self._nudged.set()
            except Exception as exc:  # noqa: BLE001 - a dead Redis must not end the listener
                if not failing:
                    log.warning("live nudges unavailable, retrying: %s", exc)
                failing = True
                await asyncio.sleep(NUDGE_RETRY_SECONDS)

    async def _loop(self) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        while True:
            # With no dashboard open there is nothing to publish: no tick until one opens
            # (it gets the whole page on connecting; changes then come at this pace).
            await self._watched.wait()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), timeout=self.interval)
            self._nudged.clear()
            if not self.subscribers:
                continue
            try:
                text = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.changes
                )
            except Exception:
                log.exception("live feed update failed")
                continue
            if text:
                try:
                    await layer.group_send(GROUP, {"type": "fleet.update", "text": text})
                except Exception:  # Redis down: this update is lost, the feed goes on
                    log.warning("live feed send failed", exc_info=True)

    def changes(self) -> str | None:
        """The rows whose content changed since the last push, as one JSON message."""
        close_old_connections()
        message = self._diff(dashboard.fleet_rows()) or {}
        plans = self._plans_diff()
        if plans:
            message["rollouts"] = plans
        # Only the newest event's id: the events page fetches its own filtered rows.
        latest = event_log.latest_event_id()
        if latest != self._sent_event:
            message["events"] = self._sent_event = latest
        return orjson.dumps(message).decode() if message else None

    def _plans_diff(self) -> dict[str, dict[str, str]]:
        """Rollout plans whose state, step or gate check moved, re-rendered."""
        plans = rollout_dashboard.recent_plans()
        keys = {plan.pk: rollout_dashboard.change_key(plan) for plan in plans}
        changed = {
            str(plan.pk): rollout_dashboard.fragments(plan)
            for plan in plans
            if self._sent_plans.get(plan.pk) != keys[plan.pk]
        }
        self._sent_plans = keys
        return changed

    def _diff(self, rows: list[dashboard.Row]) -> dict[str, Any] | None:
        keys = {row.worker.pk: row.key for row in rows}
        changed = {
            str(row.worker.pk): dashboard.render_row(row)
            for row in rows
            if self._sent_keys.get(row.worker.pk) != row.key
        }
        removed = [pk for pk in self._sent_keys if pk not in keys]
        totals = dashboard.render_totals(rows)
        banner = problems.render_problems(rows)
        if (
            not changed
            and not removed
            and (totals, banner) == (self._sent_totals, self._sent_problems)
        ):
            return None
        self._sent_keys, self._sent_totals, self._sent_problems = keys, totals, banner
        return {
            "rows": changed,
            "removed": removed,
            "order": [row.worker.pk for row in rows],
            "totals": totals,
            "problems": banner,
        }


def full_message() -> str:
    """Everything, for a page that just (re)connected and may have missed updates."""
    close_old_connections()
    rows = dashboard.fleet_rows()
    message = {
        "rows": {str(row.worker.pk): dashboard.render_row(row) for row in rows},
        "removed": [],
        "order": [row.worker.pk for row in rows],
        "totals": dashboard.render_totals(rows),
        "problems": problems.render_problems(rows),
        "full": True,
        "events": event_log.latest_event_id(),
        "rollouts": {
            str(plan.pk): rollout_dashboard.fragments(plan)
            for plan in rollout_dashboard.recent_plans()
        },
    }
    return orjson.dumps(message).decode()


publisher = LivePublisher()
