"""Every router's subscription to its workers' KV cache events (routing.kv.kv_stream), following
the snapshot as workers come and go, and what it shows on /metrics and /list_workers.

Every router process subscribes to every worker that has a ``kv_events`` endpoint, so all
routers hold the same index (routing.kv.kv_index) by construction, with no state shared between
them. Twice a second, off the request path, the set of streams is compared with the snapshot:
a new worker (or a changed endpoint) gets a stream, a worker gone loses its stream and its
index. Requests only read the index, in memory.

On /metrics, per worker (labelled as the other router series), this router's own stream:

* ``controlpanel_router_kv_events_connected{worker}``: 1 while the SUB socket is connected;
* ``controlpanel_router_kv_events_total{worker}`` and ``..._kv_event_batches_total{worker}``:
  events and batches applied; ``controlpanel_router_kv_events_per_second{worker}`` over the
  last 10 s;
* ``controlpanel_router_kv_events_last_seq{worker}``: the last sequence number seen;
* ``controlpanel_router_kv_events_gaps_total{worker}``, ``..._replays_total{worker,outcome}``
  (complete, empty, incomplete, failed), ``..._malformed_total{worker}``,
  ``..._errors_total{worker}``, ``..._connect_retries_total{worker}``;
* ``controlpanel_router_kv_index_blocks{worker}`` and ``controlpanel_router_kv_index_trusted
  {worker}`` (1: the index answers; 0: unknown, the policies fall back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from routing.fleet.snapshot import Snapshot, WorkerView
from routing.kv.kv_index import KvIndex

if TYPE_CHECKING:
    import zmq.asyncio

    from routing.kv.kv_stream import KvStream

log = logging.getLogger(__name__)

FOLLOW_INTERVAL_S = 0.5  # after a failed follow(), tried again this soon
# What each router reports of a stream to the control plane (the worker page's table).
REPORTED_STREAM_FIELDS = (
    "connected", "events_per_s", "last_seq", "last_batch_age_s", "gaps", "malformed",
    "last_error", "retry_interval_ms",
)  # fmt: skip
# StreamStats attribute, family name (prometheus_client appends _total), help.
_COUNTERS = (
    ("events", "controlpanel_router_kv_events", "KV events applied"),
    ("batches", "controlpanel_router_kv_event_batches", "KV event batches applied"),
    ("gaps", "controlpanel_router_kv_events_gaps", "KV event sequence gaps"),
    ("malformed", "controlpanel_router_kv_events_malformed", "Undecodable KV event messages"),
    ("errors", "controlpanel_router_kv_events_errors", "KV event socket and replay errors"),
    ("connect_retries", "controlpanel_router_kv_events_connect_retries", "Reconnections"),
)


class KvSubscriber:
    """The router's KV event streams, one per worker with an endpoint."""

    def __init__(
        self,
        index: KvIndex,
        snapshot: Callable[[], Snapshot],
        follow_interval: float = FOLLOW_INTERVAL_S,
    ) -> None:
        self.index = index
        self._snapshot = snapshot
        self._interval = follow_interval
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self.streams: dict[int, KvStream] = {}

    async def start(self) -> None:
        self._changed = asyncio.Event()  # made here: an Event belongs to the loop it waits on
        self._task = asyncio.create_task(self._follow(), name="kv-events-follow")

    def snapshot_changed(self) -> None:
        """A new snapshot is in (RouterState.install): follow its endpoints now. Between
        snapshots nothing can change what to follow, so nothing wakes this up meanwhile."""
        if self._changed is not None:
            self._changed.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for worker_id in list(self.streams):
            await self.streams.pop(worker_id).stop()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _follow(self) -> None:
        assert self._changed is not None, "start() first"
        while True:
            self._changed.clear()
            try:
                await self.follow(self._snapshot().workers)
            except Exception:  # a bug here must not stop following the fleet
                log.exception("following the workers' KV event endpoints failed")
                await asyncio.sleep(self._interval)  # then again, snapshot or not
                continue
            await self._changed.wait()

    async def follow(self, workers: Iterable[WorkerView]) -> None:
        """Make the streams match these workers' endpoints."""
        wanted = {w.id: (w.kv_events, w.kv_events_replay) for w in workers if w.kv_events}
        for worker_id, stream in list(self.streams.items()):
            stats = stream.stats
            if wanted.get(worker_id) != (stats.endpoint, stats.replay_endpoint):
                del self.streams[worker_id]
                await stream.stop()
        for worker_id, (endpoint, replay) in wanted.items():
            if worker_id not in self.streams:
                from routing.kv.kv_stream import KvStream  # see _context

                stream = self.streams[worker_id] = KvStream(
                    self._context(), self.index, worker_id, endpoint, replay
                )
                stream.start()

    def _context(self) -> zmq.asyncio.Context:
        """The zmq context, made with the first stream: pyzmq and msgspec (the streams'
        module's) are imported only by a router with a worker that publishes KV events."""
        if self._ctx is None:
            import zmq.asyncio

            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def worker_status(self, worker_id: int) -> dict[str, Any] | None:
        """A worker's stream and index, for the worker listing (None: no endpoint)."""
        stream = self.streams.get(worker_id)
        if stream is None:
            return None
        shown = stream.stats.as_dict(time.time())
        status = self.index.status(worker_id)
        shown["index"] = (
            None
            if status is None
            else {
                "trust": status.trust,
                "blocks": status.blocks,
                "block_size": status.block_size,
                "restarts": status.restarts,
                "clears": status.clears,
                "orphans": status.orphans,
                "evicted": status.evicted,
            }
        )
        return shown

    def report(self) -> dict[int, dict[str, Any]]:
        """Every stream in brief, for the control plane's worker pages (routing.refresher)."""
        out = {}
        for worker_id in self.streams:
            status = self.worker_status(worker_id) or {}
            index = status.get("index") or {}
            out[worker_id] = {
                **{k: status.get(k) for k in REPORTED_STREAM_FIELDS},
                "trust": index.get("trust"),
                "blocks": index.get("blocks"),
            }
        return out

    def families(self, label: Callable[[int], str]) -> Iterator[Metric]:
        """This router's streams on /metrics; `label` names a worker as the other series do."""
        rows = [(label(worker_id), stream) for worker_id, stream in self.streams.items()]
        yield from _stream_families(rows, time.time())
        yield from _index_families([(name, s.worker_id) for name, s in rows], self.index)


def _stream_families(rows: list[tuple[str, KvStream]], now: float) -> Iterator[Metric]:
    prefix = "controlpanel_router_kv_events"
    gauges = {
        "connected": GaugeMetricFamily(
            f"{prefix}_connected", "1 while the KV event socket is connected", labels=["worker"]
        ),
        "rate": GaugeMetricFamily(
            f"{prefix}_per_second", "KV events applied per second (10 s)", labels=["worker"]
        ),
        "seq": GaugeMetricFamily(
            f"{prefix}_last_seq", "Last KV event sequence number seen", labels=["worker"]
        ),
    }
    counters = {
        attr: CounterMetricFamily(name, doc, labels=["worker"]) for attr, name, doc in _COUNTERS
    }
    replays = CounterMetricFamily(
        f"{prefix}_replays", "KV event replays by outcome", labels=["worker", "outcome"]
    )
    for name, stream in rows:
        s = stream.stats
        gauges["connected"].add_metric([name], 1.0 if s.connected else 0.0)
        gauges["rate"].add_metric([name], s.events_per_second(now))
        if s.last_seq is not None:
            gauges["seq"].add_metric([name], float(s.last_seq))
        for key in counters:
            counters[key].add_metric([name], float(getattr(s, key)))
        for outcome, count in s.replays.items():
            replays.add_metric([name, outcome], float(count))
    yield from gauges.values()
    yield from counters.values()
    yield replays


def _index_families(rows: list[tuple[str, int]], index: KvIndex) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "controlpanel_router_kv_index_blocks", "Cached blocks the KV index holds", labels=["worker"]
    )
    trusted = GaugeMetricFamily(
        "controlpanel_router_kv_index_trusted",
        "1 when the worker's KV index is trusted, 0 while unknown",
        labels=["worker"],
    )
    for name, worker_id in rows:
        status = index.status(worker_id)
        blocks.add_metric([name], float(status.blocks if status else 0))
        trusted.add_metric([name], 1.0 if index.is_known(worker_id) else 0.0)
    yield blocks
    yield trusted
