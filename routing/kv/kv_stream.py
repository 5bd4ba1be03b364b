"""One worker's KV event stream: a pyzmq asyncio SUB socket feeding the router's KvIndex.

Runs as one task per worker on the router's loop, never on a request. What it does:

* **Connect.** The SUB socket subscribes to every topic (one socket per worker, so there is
  nothing to filter) and lets ZeroMQ reconnect by itself, from ``RECONNECT_MIN_MS`` doubling
  (with jitter) up to ``RECONNECT_MAX_MS``: an unreachable endpoint is retried with backoff,
  and each retry and its interval is visible in :class:`StreamStats`. ZMTP heartbeats notice
  a peer that vanished without closing. A socket that cannot even be made (a bad endpoint)
  is retried by this task with the same doubling.
* **Sequence.** Each batch's number goes through :meth:`KvIndex.check_sequence`. A gap is
  repaired by a replay (a DEALER to the worker's replay endpoint) when there is one;
  otherwise the worker stays unknown until its cache is emptied (a restart or a clear).
* **Connection state.** Once connected, with a replay endpoint, the index is rebuilt from
  the engine's first batch (an empty replay means an engine that has stored nothing). A lost
  connection makes the worker unknown: without a replay endpoint its index is emptied (the
  engine may have restarted meanwhile); with one, its blocks are kept until the reconnection,
  when the replay of the last batch applied tells whether the engine is the same (that batch
  comes back byte for byte): then only what was missed is replayed, else it is rebuilt from
  the first batch. A failed replay pauses replays for ``REPLAY_RETRY_S``.
* **Bad input.** A malformed message is logged (at most once a minute per worker), counted,
  and makes the worker unknown, since events were lost; the stream carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from routing.kv.kv_events import (
    END_OF_REPLAY,
    MalformedBatch,
    apply_batch,
    decode_batch,
    published_message,
    replay_request,
    replayed_message,
)
from routing.kv.kv_index import KvIndex, SeqVerdict

log = logging.getLogger(__name__)

RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 5_000
HEARTBEAT_MS = 2_000  # ZMTP ping interval; the peer is gone after 3 unanswered
RECEIVE_HWM = 100_000  # batches queued in the socket while a replay runs
REPLAY_TIMEOUT_S = 5.0  # for each frame of a replay's answer
REPLAY_RETRY_S = 30.0  # after a failed replay, gaps go unreplayed this long
SESSION_HEALTHY_S = 10.0  # a session that lasted this long resets the retry pause
RATE_WINDOW_S = 10
_MAX_PER_WAKE = 512  # batches handled before other tasks (requests) get the loop again
_LOG_EVERY_S = 60.0
_MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CONNECT_DELAYED
)


@dataclass(slots=True)
class StreamStats:
    """What the router shows of one worker's stream (listing, /metrics)."""

    endpoint: str
    replay_endpoint: str
    connected: bool = False
    connected_at: float | None = None
    batches: int = 0
    events: int = 0
    last_seq: int | None = None
    last_batch_at: float | None = None
    gaps: int = 0
    replays: Counter[str] = field(default_factory=Counter)  # by outcome
    malformed: int = 0
    errors: int = 0
    last_error: str | None = None
    connect_retries: int = 0
    retry_interval_ms: int | None = None  # ZeroMQ's current reconnect interval
    disconnects: int = 0
    # (second, events) buckets of the last RATE_WINDOW_S seconds, for events per second.
    recent: deque[list[int]] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW_S + 1))

    def count_events(self, n: int, now: float) -> None:
        self.batches += 1
        self.events += n
        self.last_batch_at = now
        second = int(now)
        if self.recent and self.recent[-1][0] == second:
            self.recent[-1][1] += n
        else:
            self.recent.append([second, n])

    def events_per_second(self, now: float) -> float:
        since = int(now) - RATE_WINDOW_S
        return sum(n for second, n in self.recent if second > since) / RATE_WINDOW_S

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint or None,
            "connected": self.connected,
            "events_per_s": round(self.events_per_second(now), 3),
            "events": self.events,
            "batches": self.batches,
            "last_seq": self.last_seq,
            "last_batch_age_s": _age(self.last_batch_at, now),
            "gaps": self.gaps,
            "replays": dict(self.replays),
            "malformed": self.malformed,
            "errors": self.errors,
            "last_error": self.last_error,
            "connect_retries": self.connect_retries,
            "retry_interval_ms": self.retry_interval_ms,
            "disconnects": self.disconnects,
        }


def _age(at: float | None, now: float) -> float | None:
    return None if at is None else round(max(0.0, now - at), 3)


class KvStream:
    """The subscription to one worker's events; start() once, stop() once."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        index: KvIndex,
        worker_id: int,
        endpoint: str,
        replay_endpoint: str = "",
    ) -> None:
        self.ctx, self.index, self.worker_id = ctx, index, worker_id
        self.stats = StreamStats(endpoint, replay_endpoint)
        self._task: asyncio.Task[None] | None = None
        self._logged_at: dict[str, float] = {}  # by message, for the once-a-minute rule
        # (seq, hash of its payload) of the last batch applied: after a lost connection, the
        # replay of that batch tells whether the same engine is still there.
        self._last_applied: tuple[int, int] | None = None
        self._replay_failed_at = float("-inf")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.worker_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.index.forget(self.worker_id)

    # -- the session loop ----------------------------------------------------------------

    async def _run(self) -> None:
        delay = RECONNECT_MIN_MS / 1000
        while True:
            started = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bad endpoint or a bug: retried, never fatal
                self._error(f"{type(exc).__name__}: {exc}")
            self._lost()
            if time.monotonic() - started > SESSION_HEALTHY_S:
                delay = RECONNECT_MIN_MS / 1000  # it worked a while: this is a new failure
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, RECONNECT_MAX_MS / 1000)

    async def _session(self) -> None:
        sub = self._subscriber()
        monitor = sub.get_monitor_socket(_MONITORED)
        try:
            sub.connect(self.stats.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_monitor(await monitor.recv_multipart())
                if sub in ready:
                    await self._drain(sub)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _subscriber(self) -> zmq.asyncio.Socket:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        return sub

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.stats.connected, self.stats.connected_at = True, time.time()
            self.stats.retry_interval_ms = None
            if self.stats.replay_endpoint:
                await self._rejoin()
        elif kind == zmq.EVENT_DISCONNECTED:
            self.stats.disconnects += 1
            self._lost()
        elif kind == zmq.EVENT_CONNECT_RETRIED:
            self.stats.connect_retries += 1
            self.stats.retry_interval_ms = int(value)

    def _lost(self) -> None:
        self.stats.connected = False
        if self.stats.replay_endpoint:
            self.index.suspend(self.worker_id)  # _rejoin verifies or starts over
        else:
            self.index.lose_stream(self.worker_id)
            self._last_applied = None

    async def _rejoin(self) -> None:
        """Connected (again), with a replay endpoint: resume where the stream stopped if the
        engine is the same one (it still has our last batch, byte for byte), else rebuild
        from its first batch. Nothing when the stream is in step already."""
        if self.index.is_suspended(self.worker_id):
            last = self._last_applied
            resumable = last is not None and self._replay_allowed()
            if resumable and last is not None and await self._replay(last[0], verify=last[1]):
                return
            self.index.lose_stream(self.worker_id)  # unverified: start over
            self._last_applied = None
        elif self.index.expected_seq(self.worker_id) is not None:
            return
        if self._replay_allowed():
            await self._replay(0)

    # -- published batches ---------------------------------------------------------------

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(_MAX_PER_WAKE):
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._on_published(frames)

    async def _on_published(self, frames: list[bytes]) -> None:
        try:
            seq, payload = published_message(frames)
        except MalformedBatch as exc:
            return self._malformed(exc)
        if self.index.is_suspended(self.worker_id):
            return await self._rejoin()  # which resends this batch once the engine is known
        expected = self.index.expected_seq(self.worker_id)
        verdict = self.index.check_sequence(self.worker_id, seq)
        self.stats.last_seq = seq
        if verdict is SeqVerdict.DUPLICATE:
            return
        if verdict is SeqVerdict.GAP:
            self.stats.gaps += 1
            if self.stats.replay_endpoint and self._replay_allowed():
                # This batch comes back with the replay, which starts at the first missed.
                await self._replay(0 if expected is None else expected)
                return
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> bool:
        self._last_applied = (seq, hash(payload))
        try:
            batch = decode_batch(payload)
            self.stats.count_events(apply_batch(self.index, self.worker_id, batch), time.time())
        except MalformedBatch as exc:
            self._malformed(exc)
            return False
        return True

    # -- replay --------------------------------------------------------------------------

    def _replay_allowed(self) -> bool:
        """After a replay failed (an unreachable replay socket costs REPLAY_TIMEOUT_S), the
        stream carries on without replays for a while rather than stall on each gap."""
        return time.monotonic() - self._replay_failed_at >= REPLAY_RETRY_S

    async def _replay(self, start: int, verify: int | None = None) -> bool:
        """Ask the replay socket for every batch from `start` and apply them; the worker
        is trusted again only if they leave no gap. With `verify` (the hash of batch
        `start` as applied before), resume after it; False when the engine's batch `start`
        is not that one (another engine, or no longer buffered) or the replay failed, the
        index then left as it was."""
        if verify is None:
            self.index.begin_replay(self.worker_id, start)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.stats.replay_endpoint)
            # A DEALER's send waits for a peer: an unreachable replay socket times out here.
            await asyncio.wait_for(dealer.send_multipart(replay_request(start)), REPLAY_TIMEOUT_S)
            outcome = await self._replayed(dealer, start, verify)
        except (TimeoutError, zmq.ZMQError, MalformedBatch) as exc:
            outcome = "failed"
            self._replay_failed_at = time.monotonic()
            self._error(f"replay from {start}: {type(exc).__name__}: {exc}")
        finally:
            dealer.close(linger=0)
        self.stats.replays[outcome] += 1
        if verify is not None and outcome in ("other_engine", "failed"):
            return False
        done = outcome in ("complete", "empty", "resumed")
        self.index.mark_replayed(self.worker_id, complete=done)
        return True

    async def _replayed(
        self, dealer: zmq.asyncio.Socket, start: int, verify: int | None = None
    ) -> str:
        resuming = verify is not None
        complete, seen = True, 0
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
            seq, payload = replayed_message(frames)
            if seq == END_OF_REPLAY:
                break
            if verify is not None:  # the first answer: is it the batch applied last?
                if seq != start or hash(payload) != verify:
                    await _read_to_end(dealer, seq)
                    return "other_engine"
                verify = None  # the same engine: what follows is what was missed
                self.index.begin_replay(self.worker_id, start + 1)
                continue
            seen += 1
            if seen % _MAX_PER_WAKE == 0:
                await asyncio.sleep(0)  # a long replay must not hold requests up
            self.stats.last_seq = max(seq, self.stats.last_seq or 0)
            verdict = self.index.check_sequence(self.worker_id, seq)
            if verdict is SeqVerdict.GAP:
                complete = False  # the buffer no longer reaches back to `start`
            if verdict is not SeqVerdict.DUPLICATE and not self._apply(seq, payload):
                complete = False
        if verify is not None:
            return "other_engine"  # nothing buffered at all: not the engine followed
        if resuming:
            return "resumed" if complete else "incomplete"
        if not seen:
            if start != 0:
                return "incomplete"  # the missed batches are no longer buffered
            self.index.mark_empty(self.worker_id)  # the engine has published nothing yet
            return "empty"
        return "complete" if complete else "incomplete"

    # -- errors --------------------------------------------------------------------------

    def _malformed(self, exc: MalformedBatch) -> None:
        self.stats.malformed += 1
        self.index.mark_unknown(self.worker_id)  # its events are lost: never trust stale
        self._log("malformed KV event batch from worker %s: %s", exc)

    def _error(self, message: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = message[:500]
        self._log("KV event stream of worker %s: %s", message)

    def _log(self, template: str, detail: object) -> None:
        now = time.monotonic()
        if now - self._logged_at.get(template, float("-inf")) >= _LOG_EVERY_S:
            self._logged_at[template] = now
            log.warning(template, self.worker_id, detail)


async def _read_to_end(dealer: zmq.asyncio.Socket, seq: int) -> None:
    """The rest of a replay's answer, unused (the DEALER is closed next)."""
    while seq != END_OF_REPLAY:
        frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
        seq, _ = replayed_message(frames)
