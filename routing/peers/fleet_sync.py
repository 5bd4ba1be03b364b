"""Many routers, one brain: what router processes and replicas share through Redis.

Every router process of a deployment (`serve --routers N`, and every replica sharing the
deployment's database and Redis) runs one `FleetSync`. Every TICK_SECONDS (50 ms), off the
request path, it makes one pipelined round trip to Redis that

* writes its own in-flight counts per worker into the deployment's `routers` hash (with
  the time, so a router that stopped ticking stops counting after ROUTER_TTL_SECONDS),
  and reads everyone else's: the "other routers" part of routing.policies.load's fused load
  (in between, routing.peers.load_push pushes each router's count changes within milliseconds);
* appends what it learned since the last tick to a stream of its own (`events:<router>`,
  one entry per tick, only when there is something): each prefix_aware decision's (model,
  worker, prompt chain), so every router builds the same prefix index, and each ejection
  or readmission this router decided;
* reads what every other live router (as the hash lists them) appended to its stream since
  the last read, never its own, and applies it:
  prefix credits to the model's policy (`credit`), ejections to the Ejector
  (`eject_shared`, `readmit_shared`).

So what one router learns reaches the others within about two ticks (100 ms). Every 0.25 s
a second round trip adds this router's token charges to the keys' budget counters and reads
the counters back (routing.admission.budgets). Keys live
under ``controlpanel:<deployment>:`` (the registry's deployment id, in the snapshot), so two
deployments, or a test run, sharing one Redis never mix. Each stream keeps its last
STREAM_MAXLEN entries; a router that starts reads what is left of its peers' streams
first, so a new replica starts warm, and a router that comes back after Redis was away goes
on from where it read.

When Redis fails (routing.shared_store marks it down for every user of the pool), each
router falls back to its own state: loads from its own counts and the reports, prefix
knowledge from its own traffic, ejections by its own failures. /health says "degraded"
and /metrics `controlpanel_router_shared_state_up 0`; the store's ping brings it back by
itself, and the sync resumes from where it read. No request waits for Redis at any time.
Bytes written and read are counted (`controlpanel_router_shared_bytes_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from routing.admission.admission import Admission
from routing.admission.auth import ClientGate
from routing.admission.leases import LEASE_SCRIPT, LEASE_TTL_MS, LeaseAsk, queued_per_worker
from routing.clients.ejection import Ejector
from routing.fleet.load_signal import LoadBoard
from routing.fleet.snapshot import Snapshot
from routing.peers.decisions import DecisionRing
from routing.peers.load_push import LoadPush
from routing.policies.base import BasePolicy
from routing.shared_store import SharedStore, redis_client, redis_errors

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

log = logging.getLogger(__name__)

TICK_SECONDS = 0.05
ROUTER_TTL_SECONDS = 2.0
STREAM_MAXLEN = 20_000
READ_COUNT = 5_000  # stream entries per read: a backlog is worked off over a few ticks
HASH_TTL_MS = 60_000
# History older than this is not applied: a prefix credit past prefix_aware's default age,
# an ejection long over.
HISTORY_SECONDS = 600.0
RINGS_SECONDS = 1.0
SYNC_TIMEOUT = 2.0  # how often the recent-decision rings are published and read


class SyncedRouter(Protocol):
    """What the sync reads and updates of its router (routing.state.RouterState)."""

    @property
    def instance_id(self) -> str: ...

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def board(self) -> LoadBoard: ...

    @property
    def inflight(self) -> defaultdict[int, int]: ...

    @property
    def admission(self) -> Admission: ...

    @property
    def gate(self) -> ClientGate: ...

    @property
    def ejector(self) -> Ejector: ...

    @property
    def decisions(self) -> DecisionRing: ...

    def route_policies(self) -> Mapping[str, BasePolicy]: ...


class FleetSync:
    def __init__(self, router: SyncedRouter, store: SharedStore, load_push: bool = True) -> None:
        self.router = router
        self.load_push = load_push
        self.store = store
        self.peers = 0  # other live routers seen at the last tick
        self.peer_ids: list[str] = []
        self.bytes_out = 0
        self.bytes_in = 0
        self.credits_applied = 0
        self.errors = 0
        self._namespace = ""
        # Peer router id -> the last entry read of its stream; a new peer's from its start.
        self._peer_streams: dict[str, str] = {}
        self._reading = False
        self._was_down = False
        self._task: asyncio.Task[None] | None = None
        self._lease_sha: str | None = None  # the lease script, once loaded into Redis
        # A pool of its own with a longer timeout than the request path's (0.25 s): nothing
        # waits for the sync, and a reply slowed by a busy event loop is not an outage.
        self._client = redis_client(store.url, SYNC_TIMEOUT, max_connections=6)
        # Count changes pushed between ticks, so loads agree at saturation (its docstring).
        self.push = LoadPush(router.instance_id, router.inflight, router.board, store, self._client)
        # The other routers' recent-decision rings (routing.telemetry.explain), read every second.
        self.peer_decisions: list[dict[str, list[dict[str, Any]]]] = []
        self._rings_at = 0.0
        self._ring_version = -1

    @property
    def up(self) -> bool:
        return self.store.up and bool(self._namespace)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="fleet-sync")
        if self.load_push:
            await self.push.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.push.stop()
        with contextlib.suppress(*redis_errors()):
            if self._namespace and self.store.up:
                await self._client.hdel(self._key("routers"), self.router.instance_id)
        await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                await self.tick()
            except Exception:  # the sync must never stop: log and carry on next tick
                self.errors += 1
                log.exception("sharing routing state failed")

    async def tick(self) -> None:
        """One round trip: publish, read, apply; then the fused loads are recomputed."""
        self._follow_deployment()
        self._enable_outboxes()
        if self.up:
            if self._was_down:
                # Idle pooled connections died with the outage unnoticed; the first use of
                # one would fail and mark Redis down again just after it came back.
                await self._client.connection_pool.disconnect(inuse_connections=False)
                self._was_down = False
            await self._exchange()
            await self._sync_budgets()
        else:
            self._was_down = True
            self._fall_back()
            self._drop_outboxes()
        snapshot = self.router.snapshot
        self.router.board.refresh(time.time(), (w.id for w in snapshot.workers))

    # -- one exchange ---------------------------------------------------------------------

    async def _exchange(self) -> None:
        state = msgpack.packb(
            {
                "ts": time.time(),
                "seq": self.push.seq,  # the last pushed message these counts are newer than
                "inflight": {k: v for k, v in self.router.inflight.items() if v},
            }
        )
        batch = self._outgoing()
        asks = self._lease_asks()
        if self.router.admission.leases.shared:
            self.router.admission.leases.hold(asks)
        try:
            if asks and self._lease_sha is None:
                self._lease_sha = await self._client.script_load(LEASE_SCRIPT)
            results = await self._pipeline(state, batch, asks).execute(raise_on_error=False)
        except redis_errors() as exc:
            self.store.mark_down(exc)
            self._fall_back()
            return
        core, grants = results[: len(results) - len(asks)], results[len(results) - len(asks) :]
        failed = next((r for r in core if isinstance(r, Exception)), None)
        if failed is not None or len(core) < 3:
            self.store.mark_down(failed or redis_errors()[0]("short pipeline answer"))
            self._fall_back()
            return
        self.bytes_out += len(state) + (len(batch) if batch is not None else 0)
        if self._reading:  # the last answer is the peers' streams, read from last tick's list
            self._apply_stream(core.pop())
        self._apply_routers(core[-1])
        # Shared from the first exchange on, asked for or not: a router without a lease yet
        # must wait a tick for one, not admit against the whole limit (which every router
        # would do at once).
        self.router.admission.leases.shared = True
        self._apply_leases(asks, grants)
        if time.monotonic() - self._rings_at >= RINGS_SECONDS:
            await self._exchange_rings()

    async def _sync_budgets(self) -> None:
        """Token budgets (routing.admission.budgets): this router's charges out, the shared counts
        in,
        every budgets.SYNC_SECONDS."""
        budgets = self.router.gate.budgets
        if not self.up or not budgets.due():
            return
        pipe = self._client.pipeline(transaction=False)
        try:
            await budgets.sync(pipe, self._namespace, self.router.snapshot.api_keys.values())
        except redis_errors() as exc:
            self.store.mark_down(exc)

    async def _exchange_rings(self) -> None:
        """This router's recent decisions out (when they moved), everyone's in."""
        self._rings_at = time.monotonic()
        ring, key, me = self.router.decisions, self._key("decisions"), self.router.instance_id
        pipe = self._client.pipeline(transaction=False)
        if ring.version != self._ring_version:
            packed = msgpack.packb({"ts": time.time(), "rings": ring.snapshot()})
            pipe.hset(key, me, packed)
            pipe.pexpire(key, HASH_TTL_MS)
            self._ring_version = ring.version
            self.bytes_out += len(packed)
        pipe.hgetall(key)
        try:
            answers = await pipe.execute()
        except redis_errors() as exc:
            self.store.mark_down(exc)
            return
        self.peer_decisions = self._peer_rings(answers[-1], me.encode())

    def _peer_rings(self, raw: Mapping[bytes, bytes], me: bytes) -> list[dict[str, Any]]:
        now, rings = time.time(), []
        for router_id, packed in raw.items():
            self.bytes_in += len(packed)
            if router_id == me:
                continue
            state = msgpack.unpackb(packed, strict_map_key=False)
            if now - float(state.get("ts", 0)) <= HASH_TTL_MS / 1000:
                rings.append(state.get("rings", {}))
        return rings

    def _pipeline(self, state: bytes, batch: bytes | None, asks: list[LeaseAsk]) -> Pipeline:
        pipe = self._client.pipeline(transaction=False)
        routers, me = self._key("routers"), self.router.instance_id
        pipe.hset(routers, me, state)
        pipe.pexpire(routers, HASH_TTL_MS)
        if batch is not None:
            own = self._key(f"events:{me}")
            pipe.xadd(own, {"r": me, "b": batch}, maxlen=STREAM_MAXLEN, approximate=True)
            pipe.pexpire(own, HASH_TTL_MS)  # a router that stops, stops being read
        pipe.hgetall(routers)
        # Each router appends to a stream of its own, so none reads its own news back.
        self._reading = bool(self._peer_streams)
        if self._reading:
            streams = {self._key(f"events:{r}"): last for r, last in self._peer_streams.items()}
            pipe.xread(streams, count=READ_COUNT)  # type: ignore[arg-type]
        now_ms = int(time.time() * 1000)
        for ask in asks:
            args = (me, ask.limit, ask.ask, ask.demand, ask.inflight, now_ms, LEASE_TTL_MS,
                    ask.weight, ask.first)  # fmt: skip
            pipe.evalsha(self._lease_sha or "", 1, self._key(ask.key), *args)
        return pipe

    def _fall_back(self) -> None:
        """Redis is away: this router's own counts and whole limits until it is back."""
        self.router.board.others = {}
        self.push.active = False
        self.push.peers.clear()
        self.peers, self.peer_ids = 0, []
        self.router.admission.leases.fall_back()

    def _lease_asks(self) -> list[LeaseAsk]:
        admission, routes = self.router.admission, self.router.snapshot.routes
        model_queued = admission.wanted()
        return list(
            admission.leases.asks(
                per_worker=admission.per_worker,
                workers=(w.id for w in self.router.snapshot.workers if w.routable),
                worker_inflight=self.router.inflight,
                worker_queued=queued_per_worker(
                    model_queued,
                    lambda m: (w.id for w in routes[m].workers) if m in routes else iter(()),
                ),
                model_limits={m: r.max_inflight for m, r in routes.items() if r.max_inflight},
                model_inflight=admission.model_inflight,
                model_queued=model_queued,
                keep=self._critical_headroom,
                weight=self._waiting_weight,
                first=self._critical_first,
            )
        )

    def _models(self, key: str) -> tuple[str, list[str]]:
        """A limit key's kind ("model" or "worker") and the models it covers."""
        kind, _, name = key.partition(":")
        if kind == "model":
            return kind, [name]
        worker = next((w for w in self.router.snapshot.workers if str(w.id) == name), None)
        return kind, [m.id for m in worker.models] if worker is not None else []

    def _waiting_weight(self, key: str) -> float:
        """The fair-share weights of the keys waiting here behind a limit
        (routing.admission.leases)."""
        queues = self.router.admission.queues
        return sum(queues[m].waiting_weight() for m in self._models(key)[1] if m in queues)

    def _critical_headroom(self, key: str, lease: int) -> int:
        """The slots of a lease kept for critical requests through the round trip: the
        largest reserve among the models it covers that have recent critical traffic."""
        routes, admission = self.router.snapshot.routes, self.router.admission
        return max(
            (admission.critical_headroom(m, routes[m].priority_reserve, lease)
             for m in self._models(key)[1] if m in routes and admission.critical_recent(m)),
            default=0,
        )  # fmt: skip

    def _critical_first(self, key: str) -> float:
        """The slots of a limit due to this router before the weights split the rest: the
        critical headroom its admission keeps (routing.admission.leases). A model's headroom is
        spread evenly over the leases of the workers serving it."""
        routes, admission = self.router.snapshot.routes, self.router.admission
        kind, models = self._models(key)
        claims = [
            admission.critical_claim(m, r.priority_reserve, r.workers, r.max_inflight)
            / (1 if kind == "model" else len(r.workers))
            for m in models if (r := routes.get(m)) is not None and r.workers
        ]  # fmt: skip
        return max(claims, default=0.0)

    def _serving(self, model: str) -> Iterator[int]:
        route = self.router.snapshot.routes.get(model)
        return (w.id for w in route.workers) if route is not None else iter(())

    def _apply_leases(self, asks: list[LeaseAsk], grants: list[Any]) -> None:
        from redis.exceptions import NoScriptError  # loaded with the client (redis_errors)

        admission = self.router.admission
        if any(isinstance(g, NoScriptError) for g in grants):
            self._lease_sha = None  # Redis restarted and forgot the script: load it again
        # A grant that failed leaves Redis's record, and so the lease, as it was.
        answered = [
            (a, int(g[0]), int(g[1]))
            for a, g in zip(asks, grants, strict=True)
            if not isinstance(g, Exception)
        ]
        grown = admission.leases.update(answered)
        if not grown:
            return
        by_id = {w.id: w for w in self.router.snapshot.workers}
        models: set[str] = set()
        for key in grown:
            kind, _, name = key.partition(":")
            if kind == "model":
                models.add(name)
            elif (worker := by_id.get(int(name))) is not None:
                models.update(m.id for m in worker.models)
        admission.wake(models)

    def _outgoing(self) -> bytes | None:
        """This tick's news as one msgpack batch: prefix credits and ejections."""
        credits = []
        for model, policy in self.router.route_policies().items():
            outbox = policy.outbox
            if outbox:
                shape = policy.shape
                credits += [[model, shape, w, array("Q", chain).tobytes()] for w, chain in outbox]
                outbox.clear()
        ejections = [list(e) for e in self.router.ejector.take_shared()]
        if not credits and not ejections:
            return None
        return bytes(msgpack.packb({"t": time.time(), "p": credits, "e": ejections}))

    def _apply_routers(self, raw: Mapping[bytes, bytes]) -> None:
        """The other live routers' in-flight counts, summed per worker (merged with what they
        pushed since: routing.peers.load_push)."""
        now, me = time.time(), self.router.instance_id.encode()
        states: dict[str, tuple[int, dict[int, int]]] = {}
        for router_id, packed in raw.items():
            self.bytes_in += len(packed)
            if router_id == me:
                continue
            state = msgpack.unpackb(packed, strict_map_key=False)
            if now - float(state.get("ts", 0)) > ROUTER_TTL_SECONDS:
                continue
            peer = router_id.decode()
            self._peer_streams.setdefault(peer, "0")
            counts = {int(w): int(n) for w, n in state.get("inflight", {}).items()}
            states[peer] = (int(state.get("seq", 0)), counts)
        self.peers, self.peer_ids = len(states), sorted(states)
        self.router.board.others = self.push.merge_hash(states)
        self.push.active = bool(states)
        for gone in set(self._peer_streams) - set(states):
            del self._peer_streams[gone]

    def _apply_stream(self, raw: Iterable[Any]) -> None:
        me = self.router.instance_id.encode()
        for stream, entries in raw or ():
            peer = (stream.decode() if isinstance(stream, bytes) else stream).rsplit(":", 1)[-1]
            for entry_id, fields in entries:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if peer in self._peer_streams:
                    self._peer_streams[peer] = last
                batch = fields.get(b"b", b"")
                self.bytes_in += len(batch)
                if fields.get(b"r") == me or not batch:
                    continue
                try:
                    self._apply_batch(msgpack.unpackb(batch, strict_map_key=False))
                except (ValueError, TypeError, KeyError, msgpack.UnpackException):
                    self.errors += 1  # one bad entry must not stop the others
                    log.warning("ignored a malformed routing-state entry %s", entry_id)

    def _apply_batch(self, batch: Mapping[str, Any]) -> None:
        age = max(0.0, time.time() - float(batch.get("t", 0)))
        if age > HISTORY_SECONDS:
            return
        policies = self.router.route_policies()
        for model, shape, worker_id, chain in batch.get("p", ()):
            policy = policies.get(model)
            if policy is not None and policy.credit(int(worker_id), list(array("Q", chain)), shape):
                self.credits_applied += 1
        ejector = self.router.ejector
        for worker_id, kind, seconds, _why in batch.get("e", ()):
            if kind == "ejected" and float(seconds) > age:
                ejector.eject_shared(int(worker_id), float(seconds) - age)
            elif kind == "readmitted":
                ejector.readmit_shared(int(worker_id))

    # -- bookkeeping ----------------------------------------------------------------------

    def _follow_deployment(self) -> None:
        deployment = self.router.snapshot.deployment
        if deployment and deployment != self._namespace:
            self._namespace, self._peer_streams = deployment, {}
            self.push.set_channel(self._key("loads"))

    def _key(self, name: str) -> str:
        return f"controlpanel:{self._namespace}:{name}"

    def _enable_outboxes(self) -> None:
        """Policies that can share get an outbox (new policies come with new snapshots)."""
        for policy in self.router.route_policies().values():
            if policy.shares and policy.outbox is None:
                policy.outbox = []

    def _drop_outboxes(self) -> None:
        """While Redis is away nothing is published later: what was learned meanwhile
        stays local, like a router on its own."""
        for policy in self.router.route_policies().values():
            if policy.outbox:
                policy.outbox.clear()
        self.router.ejector.take_shared()

    def status(self) -> dict[str, Any]:
        """For /health."""
        return {
            "up": self.up,
            "peers": self.peers,
            "peer_ids": self.peer_ids,
            "instance_id": self.router.instance_id,
            "deployment": self._namespace or None,
        }
