"""Pushed in-flight counts: how several routers' views of a worker's load agree within a
millisecond, not a sync tick.

routing.peers.fleet_sync shares every router's in-flight counts per worker through a Redis hash,
every 50 ms. That is enough for prefix knowledge and ejections, and not for load at
saturation: when every batch slot of a pool is taken, a stream that ends through router B
frees one slot, and the client's next request, sent through router A a millisecond later,
finds that slot still counted and lands on a full worker, where it waits a whole stream. So
each router also pushes its count changes through Redis pub/sub, on one channel per
deployment (``controlpanel:<deployment>:loads``):

* **Sending.** The request path only notes which worker's count moved (`changed`: a set add
  and, when the sender sleeps, an event set). The sender task, off the path, publishes this
  router's current count for every worker noted since its last message, as its id, a
  space and one msgpack ``[seq, {worker id: count}]``. One message is in flight at a time,
  and the next leaves at least PUSH_MIN_GAP_SECONDS (5 ms) after the one before: a lone
  change goes at once, and under load the changes batch by themselves, so a router sends
  at most 200 messages a second however many requests it serves. Nothing is sent while no
  other router is live or Redis is down.
* **Telling before the client knows.** A slot freed by a finished request is given back
  when the worker's last bytes arrive, and those bytes (a stream's ``data: [DONE]``) reach
  the client only once Redis has taken the message (`delivered`, at most
  DELIVERY_WAIT_SECONDS): Redis writes it to every subscriber as it answers the publisher,
  so it is on its way to the other routers before the client can send its next request,
  through whichever router. Without the wait, a closed-loop client (under 1 ms) beat the
  message through Redis (1-4 ms on a busy 2-core machine): bench/RESULTS.md. The wait
  costs a stream's end one Redis round trip, and only while other routers are live.
* **Receiving.** One subscriber task per router applies a peer's message to that peer's
  counts, and the difference at once to the fused loads (`LoadBoard.shift`). Its own
  messages come back too (one channel for all); they are dropped by their id prefix,
  unparsed.
* **Agreeing with the hash.** Counts are absolute, per router and worker, and each router
  numbers its messages (`seq`). The hash state carries the number of the last message sent
  before it, so whichever of the two is newer wins: a hash read that is older than pushes
  already applied is ignored for that peer, and a newer one replaces them. A missed message
  (a lost subscription, a number skipped) makes the next hash state win whatever its number.

Absent without Redis. When Redis is away, nothing is pushed and routing.peers.fleet_sync's
fallback (each router its own counts) applies; the subscriber resubscribes by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from routing.shared_store import redis_errors

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from routing.fleet.load_signal import LoadBoard
    from routing.shared_store import SharedStore

log = logging.getLogger(__name__)

RESUBSCRIBE_SECONDS = 0.5
# Messages a router sends leave at least this far apart: a lone change goes at once, and
# under load the changes of 5 ms go in one message (at most 200 a second per router).
PUSH_MIN_GAP_SECONDS = 0.005
# The longest a finished request's last bytes wait for its release to reach Redis: past
# it, Redis is slow enough that the client should not wait for it.
DELIVERY_WAIT_SECONDS = 0.02


@dataclass
class PeerCounts:
    seq: int = -1
    counts: dict[int, int] = field(default_factory=dict)
    gap: bool = False  # a message was missed: the next hash state wins whatever its seq


class LoadPush:
    def __init__(
        self, me: str, own: Mapping[int, int], board: LoadBoard, store: SharedStore,
        client: aioredis.Redis,
    ) -> None:  # fmt: skip
        self.me, self.own, self.board, self.store = me, own, board, store
        self.client = client
        self.channel = ""  # set by routing.peers.fleet_sync once the deployment is known
        self._prefix = me.encode() + b" "
        self.seq = 0
        self.active = False  # other routers are live and Redis is up
        self.peers: dict[str, PeerCounts] = {}
        self.sent = self.received = self.bytes_out = self.bytes_in = self.malformed = 0
        self.errors = 0
        self._dirty: set[int] = set()
        self._wake = asyncio.Event()
        # Waiting for the next message (changes noted since the last one), and for the one
        # being published: each resolved once Redis has answered it (or failed to).
        self._waiters: list[asyncio.Future[None]] = []
        self._publishing: list[asyncio.Future[None]] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None

    # -- the request path -----------------------------------------------------------------

    def changed(self, worker_id: int) -> None:
        """This router's count on `worker_id` moved: publish it soon."""
        if self.active:
            self._dirty.add(worker_id)
            if not self._wake.is_set():
                self._wake.set()

    async def delivered(self) -> None:
        """Returns once every change noted so far is in a message Redis has answered, or
        after DELIVERY_WAIT_SECONDS, or at once when nothing is pending."""
        if self._dirty:
            waiters = self._waiters
        elif self._publishing is not None:
            waiters = self._publishing
        else:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(done)
        await asyncio.wait((done,), timeout=DELIVERY_WAIT_SECONDS)

    # -- off the path ---------------------------------------------------------------------

    async def start(self) -> None:
        self._sender = asyncio.create_task(self._send_loop(), name="load-push-send")
        self._listener = asyncio.create_task(self._listen_loop(), name="load-push-listen")

    async def stop(self) -> None:
        tasks = [t for t in (self._sender, self._listener) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def set_channel(self, channel: str) -> None:
        """The deployment's channel; a new one (the deployment id changed) resubscribes."""
        if channel == self.channel:
            return
        self.channel = channel
        if self._listener is not None:
            self._listener.cancel()
            self._listener = asyncio.create_task(self._listen_loop(), name="load-push-listen")

    def merge_hash(self, live: Mapping[str, tuple[int, Mapping[int, int]]]) -> dict[int, int]:
        """The peers' hash states read at a sync tick, merged with what was pushed since:
        returns the other routers' in flight summed per worker."""
        for peer in [p for p in self.peers if p not in live]:
            del self.peers[peer]
        others: dict[int, int] = {}
        for peer, (seq, counts) in live.items():
            known = self.peers.get(peer)
            if known is None or known.gap or seq >= known.seq:
                known = self.peers[peer] = PeerCounts(seq, {w: n for w, n in counts.items() if n})
            for worker_id, count in known.counts.items():
                others[worker_id] = others.get(worker_id, 0) + count
        return others

    def take(self, data: bytes) -> None:
        """A message off the channel: applied, or counted and logged if malformed (one bad
        message must not stop the subscriber)."""
        self.bytes_in += len(data)
        try:
            self.apply(data)
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError, msgpack.UnpackException):
            self.malformed += 1
            log.warning("ignored a malformed pushed load message (%d bytes)", len(data))

    def apply(self, data: bytes) -> None:
        """One peer's pushed message: its new counts, and the differences to the loads."""
        if data.startswith(self._prefix):
            return  # this router's own, back from the channel
        sender, _, packed = data.partition(b" ")
        seq, counts = msgpack.unpackb(packed, strict_map_key=False)
        if not (
            isinstance(seq, int)
            and isinstance(counts, dict)
            and all(isinstance(w, int) and isinstance(n, int) for w, n in counts.items())
        ):
            raise TypeError("a pushed load message is [seq, {worker id: count}]")
        known = self.peers.get(sender.decode())
        if known is None or seq <= known.seq:
            return  # a router not seen live yet is taken in from its hash state
        known.gap = known.gap or seq != known.seq + 1
        known.seq = seq
        self.received += 1
        for worker_id, count in counts.items():
            old = known.counts.get(worker_id, 0)
            if count:
                known.counts[worker_id] = count
            else:
                known.counts.pop(worker_id, None)
            if count != old:
                self.board.shift(int(worker_id), count - old)

    async def _send_loop(self) -> None:
        loop, last = asyncio.get_running_loop(), 0.0
        while True:
            await self._wake.wait()
            if (wait := last + PUSH_MIN_GAP_SECONDS - loop.time()) > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            last = loop.time()
            if not self._dirty:
                continue
            counts = {w: self.own.get(w, 0) for w in self._dirty}
            self._dirty.clear()
            self._publishing = publishing = self._waiters
            self._waiters = []
            try:
                await self._publish(counts)
            finally:
                self._publishing = None
                for done in publishing:
                    if not done.done():
                        done.set_result(None)

    async def _publish(self, counts: dict[int, int]) -> None:
        if not (self.active and self.channel and self.store.up):
            return
        self.seq += 1
        packed = self._prefix + msgpack.packb([self.seq, counts])
        try:
            await self.client.publish(self.channel, packed)
        except redis_errors() as exc:
            # Not marked down here: a publish sent during an outage can time out after
            # Redis is back, and the sync tick and the store's ping judge outages.
            self.errors += 1
            log.debug("pushing in-flight counts failed: %s", exc)
            return
        self.sent += 1
        self.bytes_out += len(packed)

    async def _listen_loop(self) -> None:
        while True:
            channel = self.channel
            if not (channel and self.store.up):
                await asyncio.sleep(RESUBSCRIBE_SECONDS)
                continue
            try:
                await self._listen(channel)
            except redis_errors() as exc:
                log.debug("load push subscription lost: %s", exc)
            for known in self.peers.values():
                known.gap = True  # messages may have been missed while unsubscribed
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    async def _listen(self, channel: str) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            while True:  # a new channel cancels this task (set_channel)
                message: dict[str, Any] | None = await pubsub.get_message(timeout=None)
                if message is None or message.get("type") != "message":
                    continue
                data = message["data"]
                self.take(data)
        finally:
            with contextlib.suppress(*redis_errors()):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
