"""`previous_response_id` routing: a Responses API follow-up goes to the worker holding its
state, in every router replica, or gets an error that says why it cannot.

vLLM keeps a stored response (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in one server's memory:
``POST /v1/responses`` with ``previous_response_id``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` work on that server only; any other answers 404.

* **Recording, off the path.** A ``/v1/responses`` answer's id is read as it is relayed
  (`IdCatcher`: streamed, from the first event, ``response.created``; whole, from the
  body's leading ``"id"``, vLLM's first field) and recorded as id -> (worker, model): a dict
  insert and an append to the outbox. Nothing else a request does changes; ``store: false``
  requests are not recorded (vLLM keeps nothing for them).
* **Shared through Redis, in batches.** A background task writes the outbox in one
  pipeline: one key per id (``controlpanel:<deployment>:response:<id>``, expiring after
  TTL_SECONDS) and one message on the deployment's ``responses`` channel, which every
  replica's subscriber applies to its own memory. So a replica hears of an id within a
  Redis round trip (1-4 ms here), and a follow-up finds it in memory. At most one batch is
  in flight; under load the records of FLUSH_MIN_GAP_SECONDS go together.
* **Telling before the client knows.** While other routers are live, the chunk that carries
  the id waits until its batch is in Redis (`delivered`, DELIVERY_WAIT_SECONDS at most), so
  the client never holds an id that another replica could not find: a background
  response's first poll, sent through another replica a millisecond later, finds it. It
  costs a ``/v1/responses`` answer one Redis round trip, once, and only with peers.
* **An id not in memory** (a replica started after it was recorded, an id evicted from
  memory, a message lost while resubscribing) costs one bounded GET of its key
  (LOOKUP_TIMEOUT_SECONDS), on this route only, timed (`lookups`, `lookup_seconds`, and
  ``lookup_ms`` in the explanation); found, it is kept in memory. With Redis down or the
  GET failed, the client gets a 503 that says so (`Unreachable`): another replica may hold
  the record, and a guess could reach a worker without the conversation. Not found anywhere, a
  follow-up is routed as any request (its worker answers vLLM's own 404, since the router
  cannot know more), and a GET or cancel is answered with vLLM's 404 at once: with no
  model to route by, any worker would be a guess.
* **A holder that is gone.** A worker that left the fleet, is draining (follow-ups are new
  work) or no longer serves the model: 404 naming the response and the worker; one that is
  unhealthy or ejected now: 503 with Retry-After, as it may come back. Never another
  worker: it would answer without the conversation, or 404. A GET or cancel still goes to
  a draining worker, which holds the response until it leaves.

Bounds: memory keeps the newest MAX_ENTRIES ids (100 000, about 20 MB), each for at most
TTL_SECONDS (24 h: a coding agent's conversation lasts hours; vLLM itself never forgets a
stored response, so the state outlives this only if the server restarts, which removes or
re-registers the worker anyway). Redis holds one small key per id for TTL_SECONDS, so its
memory is the deployment's response rate times a day (about 100 bytes each). Without Redis
a single router's memory is exact; while a configured Redis is down, replicas still route
the ids they hold in memory, and refuse the others with a 503 until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import orjson

from routing.asgi_types import Message, Send
from routing.shared_store import redis_client, redis_errors

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from routing.shared_store import SharedStore

log = logging.getLogger(__name__)


class Answering(Protocol):
    """The request whose answer may carry a response id (routing.exchange.Exchange)."""

    @property
    def send(self) -> Send: ...

    @property
    def worker_id(self) -> int | None: ...

    @property
    def model(self) -> str: ...


PATH = "/v1/responses"
BY_ID_PREFIX = "/v1/responses/"
MAX_ENTRIES = 100_000
TTL_SECONDS = 24 * 3600
FLUSH_MIN_GAP_SECONDS = 0.005
DELIVERY_WAIT_SECONDS = 0.05
LOOKUP_TIMEOUT_SECONDS = 0.25  # the store's own timeout for request-path calls
RESUBSCRIBE_SECONDS = 0.5
MAX_ID_CHARS = 256
_SCAN_BYTES = 64 * 1024  # of an answer's head, searched for its id
_LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')
DECISION = "previous_response"


@dataclass(frozen=True, slots=True)
class Holder:
    """Where a response's state lives, and how this router learned it."""

    response_id: str
    worker_id: int
    model: str
    found_in: str  # "memory" or "redis"
    lookup_ms: float | None = None

    def shown(self) -> dict[str, Any]:
        return {"response_id": self.response_id, "found_in": self.found_in,
                "lookup_ms": self.lookup_ms}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Unreachable:
    """An id not in memory while the deployment's shared state cannot be asked: another
    replica may have recorded it, so routing it anyway could reach a worker without it."""

    response_id: str
    why: str

    def message(self) -> str:
        return (f"Response '{self.response_id}' cannot be located now: {self.why}; "
                "retry later.")  # fmt: skip


def by_id(path: str, method: str) -> tuple[str, bool] | None:
    """(response id, whether a cancel) for GET /v1/responses/{id} and POST .../cancel."""
    rest = path[len(BY_ID_PREFIX) :]
    cancel = rest.endswith("/cancel")
    rid = rest[: -len("/cancel")] if cancel else rest
    if not rid or "/" in rid or len(rid) > MAX_ID_CHARS:
        return None
    return (rid, cancel) if method == ("POST" if cancel else "GET") else None


def previous_id(payload: Mapping[str, Any]) -> str | None:
    value = payload.get("previous_response_id")
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


class ResponseAffinity:
    """Response id -> (worker, model) for this router, shared with its replicas."""

    def __init__(
        self, me: str, store: SharedStore | None, namespace: Callable[[], str],
        peers_live: Callable[[], bool],
    ) -> None:  # fmt: skip
        self.me, self.store = me, store
        self._namespace, self._peers_live = namespace, peers_live
        self._prefix = me.encode() + b" "
        self.held: dict[str, tuple[int, str, float]] = {}  # id -> worker, model, expiry
        self.recorded = self.applied = self.lookups = self.found_remote = self.errors = 0
        self.unreachable = 0  # ids refused since Redis could not say where they live
        self.lookup_seconds = 0.0
        self._outbox: list[tuple[str, int, str]] = []
        self._wake = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._publishing: list[asyncio.Future[None]] | None = None
        self._client: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- the request path -------------------------------------------------------------------

    def record(self, response_id: str, worker_id: int, model: str) -> None:
        self._keep(response_id, worker_id, model)
        self.recorded += 1
        if self.store is not None:
            self._outbox.append((response_id, worker_id, model))
            self._wake.set()

    def sharing(self) -> bool:
        return self.store is not None and self.store.up and self._peers_live()

    async def delivered(self) -> None:
        """Returns once every id recorded so far is in Redis, or after
        DELIVERY_WAIT_SECONDS, or at once when nothing is pending."""
        waiters = self._waiters if self._outbox else self._publishing
        if waiters is None:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(done)
        await asyncio.wait((done,), timeout=DELIVERY_WAIT_SECONDS)

    async def find(self, response_id: str) -> Holder | Unreachable | None:
        """From memory, else one bounded Redis GET (kept in memory when found); Unreachable
        when the deployment shares state in Redis but Redis cannot answer now."""
        held = self.held.get(response_id)
        if held is not None:
            if held[2] > time.time():
                return Holder(response_id, held[0], held[1], "memory")
            del self.held[response_id]
        store, namespace = self.store, self._namespace()
        if store is None or not namespace:
            return None  # a single router: its memory is the whole truth
        if not store.up:
            self.unreachable += 1
            return Unreachable(response_id, "the routers' shared state (Redis) is down")
        started = perf_counter()
        self.lookups += 1
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_SECONDS):
                raw = await store.client.get(_key(namespace, response_id))
        except redis_errors() as exc:
            self.errors += 1  # an outage is the store's ping to judge, not one lookup's
            log.debug("looking up response %s failed: %s", response_id, exc)
            self.lookup_seconds += perf_counter() - started
            self.unreachable += 1
            return Unreachable(response_id, f"the routers' shared state (Redis) failed: {exc}")
        took = perf_counter() - started
        self.lookup_seconds += took
        if raw is None:
            return None
        worker_id, model = msgpack.unpackb(raw)
        self.found_remote += 1
        self._keep(response_id, int(worker_id), str(model))
        return Holder(response_id, int(worker_id), str(model), "redis", round(took * 1000, 2))

    def catch_ids(self, ex: Answering, payload: Mapping[str, Any]) -> Send:
        """ex.send, wrapped to record the answer's response id (not for store: false)."""
        if payload.get("store") is False:
            return ex.send
        return IdCatcher(ex, self).send

    # -- off the path -----------------------------------------------------------------------

    async def start(self) -> None:
        if self.store is None or self._tasks:
            return
        # Its own small pool: the subscriber holds a connection, and nothing here may wait
        # behind the request path's calls (or make them wait).
        self._client = redis_client(self.store.url, 2.0, max_connections=4)
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name="responses-flush"),
            asyncio.create_task(self._listen_loop(), name="responses-listen"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()

    def take(self, data: bytes) -> None:
        """A peer's batch off the channel, into memory (its own come back: dropped)."""
        if data.startswith(self._prefix):
            return
        try:
            _, _, packed = data.partition(b" ")
            for response_id, worker_id, model in msgpack.unpackb(packed):
                self._keep(str(response_id), int(worker_id), str(model))
                self.applied += 1
        except (ValueError, TypeError, msgpack.UnpackException):
            self.errors += 1
            log.warning("ignored a malformed response-id message (%d bytes)", len(data))

    def _keep(self, response_id: str, worker_id: int, model: str) -> None:
        held = self.held
        held.pop(response_id, None)  # re-inserted last: the eviction order is by arrival
        held[response_id] = (worker_id, model, time.time() + TTL_SECONDS)
        if len(held) > MAX_ENTRIES:
            del held[next(iter(held))]

    async def _flush_loop(self) -> None:
        loop, last = asyncio.get_running_loop(), 0.0
        while True:
            await self._wake.wait()
            if (wait := last + FLUSH_MIN_GAP_SECONDS - loop.time()) > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            last = loop.time()
            batch, self._outbox = self._outbox, []
            self._publishing = publishing = self._waiters
            self._waiters = []
            try:
                await self._write(batch)
            finally:
                self._publishing = None
                for done in publishing:
                    if not done.done():
                        done.set_result(None)

    async def _write(self, batch: list[tuple[str, int, str]]) -> None:
        namespace, client = self._namespace(), self._client
        if not batch or not namespace or client is None or not (self.store and self.store.up):
            return  # kept in memory only: a replica that asks later will not find these
        pipe = client.pipeline(transaction=False)
        for response_id, worker_id, model in batch:
            packed = msgpack.packb([worker_id, model])
            pipe.set(_key(namespace, response_id), packed, px=TTL_SECONDS * 1000)
        pipe.publish(_channel(namespace), self._prefix + msgpack.packb(batch))
        try:
            await pipe.execute()
        except redis_errors() as exc:
            self.errors += 1
            log.debug("sharing %d response ids failed: %s", len(batch), exc)

    async def _listen_loop(self) -> None:
        while True:
            namespace = self._namespace()
            if namespace and self.store is not None and self.store.up and self._client:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(_channel(namespace))
                    while self._namespace() == namespace:
                        message = await pubsub.get_message(timeout=RESUBSCRIBE_SECONDS)
                        if message is not None and message.get("type") == "message":
                            self.take(message["data"])
                except redis_errors() as exc:
                    log.debug("response-id subscription lost: %s", exc)
                finally:
                    with contextlib.suppress(*redis_errors()):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    def status(self) -> dict[str, Any]:
        return {"held": len(self.held), "recorded": self.recorded, "applied": self.applied,
                "lookups": self.lookups, "found_remote": self.found_remote,
                "lookup_seconds": round(self.lookup_seconds, 4), "errors": self.errors,
                "unreachable": self.unreachable}  # fmt: skip


def _key(namespace: str, response_id: str) -> str:
    return f"controlpanel:{namespace}:response:{response_id}"


def _channel(namespace: str) -> str:
    return f"controlpanel:{namespace}:responses"


class IdCatcher:
    """Reads a 200 answer's response id from its first bytes and records it."""

    __slots__ = ("_buffer", "_ex", "_next", "_on", "_pins", "_sse")

    def __init__(self, ex: Answering, pins: ResponseAffinity) -> None:
        self._ex, self._pins, self._next = ex, pins, ex.send
        self._on, self._sse, self._buffer = False, False, b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._on = message["status"] == 200
            # As the worker sent them: any case (aiohttp's raw headers).
            kinds = [v for k, v in message.get("headers", ()) if k.lower() == b"content-type"]
            self._sse = bool(kinds) and kinds[0].startswith(b"text/event-stream")
            self._buffer = b""
        elif self._on and (chunk := message.get("body", b"")):
            self._buffer += chunk
            found = self._found()
            if found is not None or len(self._buffer) > _SCAN_BYTES:
                self._on, self._buffer = False, b""
            if found:
                ex = self._ex
                if ex.worker_id is not None:
                    self._pins.record(found, ex.worker_id, ex.model)
                if self._pins.sharing():  # the id reaches the client only once shared
                    await self._pins.delivered()
        await self._next(message)

    def _found(self) -> str | None:
        """The id, "" when the answer has none, None while more bytes are needed."""
        if not self._sse:  # vLLM writes the id first: past its longest, there is none
            match = _LEADING_ID.match(self._buffer)
            if match is None:
                return None if len(self._buffer) < MAX_ID_CHARS + 32 else ""
            return match.group(1).decode()
        end = self._buffer.find(b"\n\n")
        if end < 0:
            return None
        for line in self._buffer[:end].split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    event = orjson.loads(line[5:])
                    if event.get("type") == "response.created":
                        return str(event["response"]["id"])
                except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                    return ""
        return ""
