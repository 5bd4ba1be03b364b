"""The /v1 hot path: a bare ASGI application in front of many vLLM servers.

Per request it reads the body once, parses it once (only to learn `model`), picks a worker
from the in-memory snapshot, forwards the untouched bytes over one long-lived aiohttp
session and relays the answer chunk by chunk as it arrives. No ORM, no Django, no buffer.
Two edits it makes, both spliced into the bytes: an alias's target name in place of the
alias (routing.aliases, renamed back in the answer), and, for a client key's stream that
did not ask for usage, `stream_options.include_usage` (routing.usage, its extra chunk cut
from the answer) so that streaming is no way around token accounting.
A client that goes away cancels the upstream request at once, so vLLM frees its KV cache.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from routing import access_log, explain, fallbacks, listings, response_affinity, response_pinning
from routing.admission import STANDARD_RANK, Admission, Ticket
from routing.aliases import ModelNameRewriter, rewrite_request_model
from routing.asgi_types import Receive, Scope, Send
from routing.auth import SCOPE_KEY as AUTH_SCOPE_KEY
from routing.auth import ClientGate, ClientKey, Refusal
from routing.cache_check import CacheCheck, CacheCheckCollector
from routing.ejection import Ejector
from routing.errors import sse_error_event
from routing.explain import DecisionRing
from routing.fleet_sync import FleetSync
from routing.kv_index import DEFAULT_MAX_BLOCKS_PER_WORKER, KvIndex
from routing.kv_subscriber import KvSubscriber
from routing.load_push import LoadPush
from routing.load_signal import DEFAULT_REPORT_MAX_AGE, LoadBoard
from routing.metrics import RequestTrace, RouterCollector, RouterMetrics, render
from routing.policies import make_policy
from routing.policies.base import BasePolicy, RequestInfo
from routing.priority import HEADER as PRIORITY_HEADER
from routing.priority import UnknownClass, request_rank
from routing.request_text import request_text
from routing.responses import refuse, respond_error
from routing.routes import MODEL_ROUTES
from routing.sessions import DEFAULT_SOURCES, Session, SessionReader, key_of
from routing.shared_store import SharedStore
from routing.snapshot import ModelRoute, Snapshot, WorkerView
from routing.tokenize import RequestTokens, TokenizeCollector
from routing.tracing import tracer_from_env
from routing.usage import ask_for_usage

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the message.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# aiohttp sets these itself from the URL and the body it sends.
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# uvicorn writes its own Date and Server; relaying the worker's too would send both twice.
# x-request-id: the router sets its own (routing.access_log), never the worker's echo twice.
RESPONSE_DROP = HOP_BY_HOP | {b"date", b"server", b"x-request-id"}
_REQUEST_DROP_REWRITING = _REQUEST_DROP | {b"accept-encoding"}
# A worker with its own key (vLLM --api-key) gets that key, never the client's header.
_DROP_FOR_KEYED_WORKER = {
    d: d | {b"authorization"} for d in (_REQUEST_DROP, _REQUEST_DROP_REWRITING)
}
_RESPONSE_DROP_RENAMED = RESPONSE_DROP | {b"content-length"}

# Answers that mean "not now, not here": safe to send to another worker before any byte.
RETRY_STATUSES = frozenset({429, 502, 503})

GC_GEN0_THRESHOLD = 20_000
_CAUSE_MAX_CHARS = 500
# How an OpenAI stream's last event ends (vLLM's too): the relay tells the other routers
# that the worker's slot is free before it passes this on.
_SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    connect_timeout: float = 5.0
    # For a free connection when the pool is full (max_connections_per_worker in use), then
    # connecting: past it the request fails like a connect timeout (retried elsewhere).
    pool_timeout: float = 30.0
    read_timeout: float = 600.0  # to the first byte, and between chunks; never overall
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 30.0  # seconds for the whole request body to arrive (else 408)
    max_header_bytes: int = 64 * 1024  # names and values together (else 431)
    require_api_key: bool = False  # client keys (routing.auth)
    max_connections: int = 2048
    max_connections_per_worker: int = 512
    retry_after_seconds: int = 2
    retries: int = 2  # extra attempts on other workers, before the first byte only
    retry_backoff: float = 0.025  # seconds; doubled per attempt, jittered by +-50%
    eject_after: int = 5  # consecutive failures that eject a worker (routing.ejection); 0: off
    eject_cooldown: float = 5.0  # seconds, doubled on each repeated ejection
    max_inflight_per_worker: int = 0  # per router process; 0: no limit (routing.admission)
    queue_timeout: float = 10.0  # seconds a request waits for room before its 429
    queue_max: int = 1000  # requests waiting per model before newcomers get 429 at once
    redis_url: str = ""  # shared state between routers (routing.shared_store, fleet_sync)
    # How long a worker's reported queue corrects the load (routing.policies.load).
    load_report_max_age: float = DEFAULT_REPORT_MAX_AGE
    load_push: bool = True  # with redis_url: push in-flight changes (routing.load_push)
    kv_index_max_blocks: int = DEFAULT_MAX_BLOCKS_PER_WORKER  # per worker (routing.kv_index)
    # Where a request's session key is read, in order (routing.sessions).
    session_sources: tuple[str, ...] = DEFAULT_SOURCES


@dataclass(slots=True, eq=False)
class Exchange:
    """One model-route request, from its first byte in to its last byte out. Created once
    per request and filled in as the request is placed, so the steps below read what they
    need from it instead of passing the ASGI triple and the routing decision along."""

    scope: Scope
    receive: Receive
    send: Send  # wrapped by the usage meter once a client key is admitted (routing.auth)
    trace: RequestTrace
    body: bytes = b""  # as forwarded: an alias's target spliced in, usage asked for
    rewriter: ModelNameRewriter | None = None  # renames an alias's answer back
    # Set once the request is placed, before the first attempt:
    policy: BasePolicy = field(init=False)
    request: RequestInfo = field(init=False)
    worker: WorkerView = field(init=False)  # the current attempt's
    # Per attempt: whether a failure before the first byte may go to another worker, whether
    # the answer went out whole and not as a 5xx (for the policy), whether the answer is
    # complete, and whether the client left before it was.
    may_retry: bool = False
    ok: bool = False
    answered: bool = False
    client_gone: bool = False
    released: bool = False  # the attempt's in-flight count already given back (_release)
    # routing.explain: the explanation when the request asked for one and may have it.
    explain: dict[str, Any] | None = None
    decision: str = ""  # the policy's kind of decision, for the recent-decisions ring
    attempts: int = 0
    # routing.fallbacks, for a model or alias that has them: the names still to try (those
    # the client's key may use), the hops taken (None: not falling back), and why the last
    # try moved on (set only while a fallback is left, and nothing was sent).
    fallbacks: tuple[str, ...] = ()
    hops: list[dict[str, str]] | None = None
    fall_back_reason: str | None = None
    # routing.priority and routing.admission: the class's rank (0: critical), the flow
    # (client key id; 0 without keys) and its fair-share weight.
    rank: int = STANDARD_RANK
    flow: int = 0
    weight: float = 1.0
    # routing.response_affinity: the worker holding the response a follow-up continues.
    pinned: response_affinity.Holder | None = None
    # routing.sessions: read once, for affinity, the fair queue, the log and explanations.
    session: Session | None = None

    def first_byte(self) -> None:
        self.trace.first_byte = perf_counter()
        self.policy.on_first_byte(self.worker, self.request)


class RouterApp:
    """The ASGI callable for router paths. `snapshot` is swapped by the refresher."""

    # Fleet gauges are the same in every replica; the control plane leaves this True on one
    # live router only, so they are not counted once per router (see routing/metrics.py).
    exports_fleet_metrics: bool = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.snapshot: Snapshot = Snapshot.empty()
        self.snapshot_error: str | None = None
        self.inflight: defaultdict[int, int] = defaultdict(int)  # this process's own
        # What the policies read: every router's in flight, corrected by reports.
        self.board = LoadBoard(self.inflight, report_max_age=self.config.load_report_max_age)
        self.loads = self.board.loads
        self.started_at = time.time()
        self.metrics = RouterMetrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RouterCollector(self))
        # kv_aware's request tokens and the cache-aware policies' predictions checked.
        self.tokens = RequestTokens()
        self.cache_check = CacheCheck()
        self.registry.register(TokenizeCollector(self.tokens))
        self.registry.register(CacheCheckCollector(self))
        # worker id -> [failures, last cause]: connection refused or reset, or no answer in
        # time, seen by real traffic; the refresher takes them for the control plane.
        self.passive_failures: dict[int, list[Any]] = {}
        self.instance_id = uuid.uuid4().hex  # this process, to the control plane and peers
        self.store = SharedStore(self.config.redis_url) if self.config.redis_url else None
        # Routing state shared with the deployment's other routers (routing.fleet_sync).
        self.sync = FleetSync(self, self.store) if self.store is not None else None
        self.push = self.sync.push if self.sync is not None and self.config.load_push else None
        self.gate = ClientGate(self.store)  # client keys, rate limits, usage (routing.auth)
        self.ejector = Ejector(self.config.eject_after, self.config.eject_cooldown)
        self.admission = Admission(
            self.config.max_inflight_per_worker, self.config.queue_timeout, self.config.queue_max
        )
        self._session: aiohttp.ClientSession | None = None
        # OpenTelemetry: None (off) unless OTEL_EXPORTER_OTLP_ENDPOINT is set (routing.tracing).
        self.tracer = tracer_from_env()
        self.decisions = DecisionRing()  # each model's latest decisions (routing.explain)
        # Workers' KV caches from their own events, fed off the request path.
        self.kv_index = KvIndex(self.config.kv_index_max_blocks)
        self.kv_events = KvSubscriber(self.kv_index, lambda: self.snapshot)
        # Which worker holds each Responses API response (routing.response_affinity).
        self.responses = response_affinity.ResponseAffinity(
            self.instance_id, self.store, lambda: self.snapshot.deployment,
            lambda: self.sync is not None and self.sync.peers > 0,
        )  # fmt: skip
        self._policies: dict[tuple[str, str, bytes], BasePolicy] = {}
        self._route_policies: dict[str, BasePolicy] = {}
        self.sessions = SessionReader(self.config.session_sources)

    def install(self, snapshot: Snapshot) -> None:
        """Swap in a new snapshot, resolving each model's policy now rather than per request.
        Both references change in one statement, so a request never sees a mix."""
        kept: dict[tuple[str, str, bytes], BasePolicy] = {}
        policies = {name: self._policy_for(route, kept) for name, route in snapshot.routes.items()}
        self.metrics.name_workers(snapshot.workers)
        self.ejector.forget({w.id for w in snapshot.workers})
        was_out = {w.id for w in self.snapshot.workers if not w.routable}
        self.ejector.readmit_recovered({w.id for w in snapshot.workers if w.routable} & was_out)
        self.snapshot, self._route_policies, self._policies = snapshot, policies, kept
        self.tokens.install(snapshot)  # new tokenizer folders load on a thread
        self.board.add_reports(
            {w.id: (w.queue_length or 0, w.queue_at) for w in snapshot.workers if w.queue_at}
        )
        self.board.refresh(time.time(), (w.id for w in snapshot.workers))

    def _policy_for(
        self, route: ModelRoute, kept: dict[tuple[str, str, bytes], BasePolicy]
    ) -> BasePolicy:
        """Policies live across snapshot swaps while their configuration is unchanged, so
        stateful ones keep what they learned; unused ones are dropped."""
        key = (route.name, route.policy, orjson.dumps(dict(route.policy_config)))
        policy = self._policies.get(key)
        if policy is None:
            policy = make_policy(route.policy, route.policy_config)
            if self.sync is not None and hasattr(policy, "outbox"):
                policy.outbox = []  # shared from its first decision on (routing.fleet_sync)
            if hasattr(policy, "kv_index"):  # kv_aware reads the exact index (routing.kv_index)
                policy.kv_index = self.kv_index
        kept[key] = policy
        return policy

    def recent_decisions(self) -> dict[str, list[dict[str, Any]]]:
        """Each model's latest decisions over this router and its peers (routing.explain),
        newest first."""
        peers = self.sync.peer_decisions if self.sync is not None else []
        return explain.merged([self.decisions.snapshot(), *peers])

    def route_policies(self) -> Mapping[str, BasePolicy]:
        """The policy instance deciding for each model now (for /metrics)."""
        return self._route_policies

    def take_passive_failures(self) -> dict[int, tuple[int, str]]:
        """The failures seen since the last call, as worker id -> (count, last cause)."""
        taken, self.passive_failures = self.passive_failures, {}
        return {worker_id: (count, cause) for worker_id, (count, cause) in taken.items()}

    def render_metrics(self) -> bytes:
        return render(self.registry)

    def list_workers(self) -> dict[str, Any]:
        """What /list_workers answers (routing.listings)."""
        return listings.worker_listing(
            self.snapshot, self.inflight, self.kv_events.worker_status, self.board.describe
        )

    def health(self) -> dict[str, Any]:
        """What /health answers (routing.listings)."""
        return listings.health_report(self)

    # --- lifecycle ------------------------------------------------------------------------

    async def startup(self) -> None:
        explain.register_local(self)
        if self._session is None:
            self._session = _new_session(self.config)
            if self.sync is not None:
                await self.sync.start()
            await self.kv_events.start()
            await self.responses.start()
        _tune_garbage_collector()

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.tokens.close()
        if self.sync is not None:
            await self.sync.stop()
        if self.store is not None:
            await self.store.close()
        await self.kv_events.stop()
        await self.responses.stop()

    async def _lazy_session(self) -> aiohttp.ClientSession:
        """For servers that skip the ASGI lifespan: make the one session on first use."""
        await self.startup()
        assert self._session is not None
        return self._session

    async def readmit_due(self) -> None:
        """Probe the workers whose ejection cool-down is over; readmit those that answer."""
        due = self.ejector.due_for_probe()
        if not due:
            return
        session = self._session or await self._lazy_session()
        by_id = {w.id: w for w in self.snapshot.workers}
        for worker_id in due:
            worker = by_id.get(worker_id)
            if worker is None:
                self.ejector.probed(worker_id, False, "left the fleet")
                continue
            healthy, detail = await _probe_health(session, worker.url)
            self.ejector.probed(worker_id, healthy, detail)

    # --- ASGI entry -----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in MODEL_ROUTES:
            return await self._proxy(scope, receive, send)
        if scope["path"].startswith(response_affinity.BY_ID_PREFIX):  # GET, cancel by id
            return await self._proxy(scope, receive, send, by_id=True)
        await listings.answer(self, scope, send)

    # --- the proxy --------------------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, by_id: bool = False) -> None:
        """One model-route request, counted and timed whatever becomes of it."""
        trace = RequestTrace(perf_counter())
        rid = trace.request_id = access_log.request_id(scope)
        ex = Exchange(scope, receive, send, trace)
        span = self.tracer.start(scope) if self.tracer is not None else None
        try:
            await (response_pinning.place_by_id(self, ex) if by_id else self._place(ex))
        except Exception:
            trace.status = trace.status or 500  # uvicorn answers an escaped error with a 500
            raise
        finally:
            self.metrics.finish(trace, perf_counter())
            if span is not None and self.tracer is not None:
                self.tracer.end(span, ex, self.metrics.worker_label)
            if ex.decision:
                worker = self.metrics.worker_label(trace.worker_id) if ex.attempts else None
                self.decisions.add(
                    trace.model, worker, ex.decision, ex.attempts, trace.status, ex.explain
                )
            if access_log.enabled():
                access_log.write(scope, trace, rid, self.metrics.worker_label(trace.worker_id))

    async def _place(self, ex: Exchange) -> None:
        """Read, parse, pick a worker and forward; every exit leaves its status in the trace."""
        scope = ex.scope
        method = scope["method"]
        if method != "POST":
            return await _reject(ex, 405, f"{method} is not allowed on {scope['path']}")
        client: ClientKey | None = None
        if self.config.require_api_key:  # before the body is read: strangers cost nothing
            checked = self.gate.authenticate(scope, self.snapshot.api_keys)
            if isinstance(checked, Refusal):
                return await refuse(ex.send, checked, ex.trace, path=scope["path"])
            client = checked
        if _headers_size(scope["headers"]) > self.config.max_header_bytes:
            limit = self.config.max_header_bytes
            return await _reject(ex, 431, f"the request headers exceed {limit} bytes")
        try:
            ex.rank, capped = request_rank(
                _header(scope, PRIORITY_HEADER), client.priority if client else None
            )
        except UnknownClass as exc:
            return await _reject(ex, 400, str(exc), "x-priority")
        if capped:
            self.metrics.priority_capped[ex.rank] += 1
        if client is not None:
            ex.flow, ex.weight = client.id, client.weight
        body = await self._read_body(ex)
        if body is None:
            return
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return await _reject(ex, 400, f"the request body is not valid JSON: {exc}")
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str) or not model:
            return await _reject(
                ex, 400, "the request body must be a JSON object with a `model`", "model"
            )
        if client is not None:  # by the name the client asked for, alias or model
            if refusal := await self.gate.admit(client, model):
                return await refuse(ex.send, refusal, ex.trace, path=scope["path"])
            if (asked := ask_for_usage(scope["path"], body, payload)) is not None:
                body = asked  # a stream that would go uncounted; the answer is cut to match
            ex.send = self.gate.metered(ex.send, client, model, cut_usage_event=asked is not None)
        ex.body = body
        ex.session = ex.trace.session = self.sessions.read(scope["headers"], payload)
        if scope["path"] == response_affinity.PATH:  # the one check other routes pay
            ex.send = self.responses.catch_ids(ex, payload)
            if (previous := response_affinity.previous_id(payload)) is not None:
                ex.pinned = await self.responses.find(previous)
                scope[access_log.PINNED_SCOPE_KEY] = (
                    ex.pinned.shown() if ex.pinned else {"response_id": previous, "found_in": None}
                )
        if scope.get(explain.SCOPE_KEY) and explain.allowed(client, self.config.require_api_key):
            ex.explain = {}  # filled in by _route once the model's route is known
        await self._route(ex, payload, model)

    async def _read_body(self, ex: Exchange) -> bytes | None:
        limit = self.config.max_body_bytes
        declared = _header(ex.scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _reject(ex, 413, f"the request body exceeds {limit} bytes")
            return None
        try:
            # A client that trickles its body (slowloris) must not hold a request open.
            async with asyncio.timeout(self.config.body_timeout):
                return await _receive_body(ex, limit)
        except TimeoutError:
            seconds = self.config.body_timeout
            await _reject(ex, 408, f"the request body did not arrive within {seconds} s")
            return None

    async def _route(self, ex: Exchange, payload: dict[str, Any], model: str) -> None:
        """Resolve an alias, pick a worker by the model's policy and forward. A name with
        fallbacks goes through _route_falling_back, which comes back here for each try."""
        alias = self.snapshot.aliases.get(model)
        if alias is not None:
            if alias.fallbacks and ex.hops is None:
                return await self._route_falling_back(ex, payload, model, alias.fallbacks)
            target = alias.choose(key_of(ex.session))
            if ex.pinned is not None:  # the target whose worker holds the response
                target = response_pinning.alias_target(ex.pinned, alias, target)
            if target is None:
                return await _reject(ex, 503, f"the alias `{model}` has no target")
            ex.body = rewrite_request_model(ex.body, payload, model, target)
            # Named back to what the client asked for, which a fallback alias is not.
            ex.rewriter = ModelNameRewriter(target, payload["model"])
            self.metrics.alias_requests[model, target] += 1
            model = target
        route = self.snapshot.routes.get(model)
        policy = self._route_policies.get(model)
        if route is None or policy is None:
            if ex.hops:  # a fallback the new snapshot no longer has: the next, or a 503
                return await self._no_worker(ex, model, fallbacks.GONE)
            return await _reject(ex, 404, f"The model `{model}` does not exist.", "model")
        # The one check a request without fallbacks pays (an alias's target brings none).
        if route.fallbacks and alias is None and ex.hops is None:
            return await self._route_falling_back(ex, payload, model, route.fallbacks)
        ex.trace.model = model  # only now: a served name, so the label set stays bounded
        if ex.pinned is not None:  # previous_response_id: its holder, or why not
            pinned = response_pinning.pin_route(self, ex, route, policy, ex.pinned)
            if isinstance(pinned, response_pinning.Gone):
                return await response_pinning.refuse_gone(ex, pinned, ex.pinned)
            route, policy = pinned
        # The prompt as text costs CPU, so only a policy that uses it gets it.
        text = request_text(payload) if policy.needs_request_text else None
        headers = ex.scope["headers"]
        workers = self.ejector.routable(route.workers)
        tokens = None
        if policy.needs_request_tokens:  # kv_aware only: local tokenizer, or the worker's
            session = self._session or await self._lazy_session()
            path = ex.scope["path"]
            tokens = await self.tokens.of(session, path, route, payload, workers, self.loads)
        ex.request = RequestInfo(model, payload, headers, text, tokens, key_of(ex.session))
        ex.policy = policy
        if ex.explain is not None:  # before select, which may learn from the request
            before = ex.explain
            self._start_explaining(ex, payload["model"], route, workers)
            explain.carry_over(before, ex.explain)  # a fallback's keeps the earlier tries
        if self.admission.limits(route.max_inflight) and workers:
            return await self._admit(ex, route, workers)
        worker = policy.select(workers, ex.request, self.loads)
        ex.decision = policy.last_decision if worker is not None else "no_worker"
        if ex.explain is not None:
            explain.decided(ex.explain, policy, worker)
        if worker is None:
            return await self._no_worker(ex, model)
        ex.worker = worker
        await self._forward_with_retries(ex, workers, model)

    async def _route_falling_back(
        self, ex: Exchange, payload: dict[str, Any], asked: str, chain: tuple[str, ...]
    ) -> None:
        """The request for `asked`, then, while a try fails before any byte went out, the next
        fallback the client's key may use (routing.fallbacks). Each try is a whole _route,
        so admission slots and counts are the try's own and released before the next."""
        ex.fallbacks = fallbacks.usable(chain, ex.scope.get(AUTH_SCOPE_KEY))
        ex.hops = []
        send = ex.send  # each try wraps it for its own policy's cache check
        await self._route(ex, payload, asked)
        while ex.fall_back_reason is not None:
            ex.send = send
            target = fallbacks.move_on(ex, payload, self.metrics.fallbacks)
            await self._route(ex, payload, target)

    def _start_explaining(
        self, ex: Exchange, asked: str, route: ModelRoute, workers: Sequence[WorkerView]
    ) -> None:
        told = ex.policy.explain(workers, ex.request, self.loads)
        ex.explain = explain.start(
            asked=asked, model=route.name, route=route, policy=ex.policy,
            told_candidates=told.candidates, admission=self.admission_room(route, workers),
            session=ex.session,
        )  # fmt: skip

    def admission_room(
        self, route: ModelRoute, workers: Sequence[WorkerView]
    ) -> dict[int, bool] | None:
        """Which workers have room under the in-flight limits now (None: no limits)."""
        if not self.admission.limits(route.max_inflight):
            return None
        return self.admission.room(route.name, workers, route.max_inflight, self.inflight)

    async def _admit(self, ex: Exchange, route: ModelRoute, workers: Sequence[WorkerView]) -> None:
        """Forward within the in-flight limits, after a bounded wait; else 429."""
        policy, request = ex.policy, ex.request

        def choose(candidates: Sequence[WorkerView]) -> WorkerView | None:
            return policy.select(candidates, request, self.loads)

        ticket = Ticket(ex.rank, ex.flow, ex.weight, route.priority_reserve)
        ticket.session = key_of(ex.session)
        worker = await self.admission.acquire(
            route.name, workers, route.max_inflight, choose, self.inflight, ticket
        )
        ex.decision = policy.last_decision if worker is not None else ticket.refused
        if ex.explain is not None:
            explain.decided(ex.explain, policy, worker)
            ex.explain["decision"] = ex.decision
        if worker is None:
            if ex.fallbacks and ticket.refused != "shed":  # nothing sent: a fallback takes it
                ex.fall_back_reason = fallbacks.SATURATED
                return
            headers = [(b"retry-after", str(self.config.retry_after_seconds).encode())]
            if ex.explain is not None:
                headers.append((explain.HEADER, explain.encode(ex.explain)))
            return await _reject(
                ex, 429, _refusal_message(ticket, route.name), extra_headers=headers
            )
        ex.worker = worker
        try:
            await self._forward_with_retries(ex, workers, route.name)
        finally:
            self.admission.release(route.name, (m.id for m in worker.models), ex.rank)

    async def _no_worker(self, ex: Exchange, model: str, reason: str = fallbacks.NO_WORKER) -> None:
        if ex.fallbacks:  # nothing sent yet: the next fallback takes it (routing.fallbacks)
            ex.fall_back_reason = reason
            return
        headers = [(b"retry-after", str(self.config.retry_after_seconds).encode())]
        if ex.explain is not None:
            headers.append((explain.HEADER, explain.encode(ex.explain)))
        what = f"model `{model}`"
        if ex.hops:  # every fallback was tried: name what the client asked for
            what = f"model `{ex.hops[0]['from']}` or any of its fallbacks"
        message = f"no worker is available for {what} right now"
        await _reject(ex, 503, message, extra_headers=headers)

    async def _forward_with_retries(
        self, ex: Exchange, workers: Sequence[WorkerView], model: str
    ) -> None:
        """Forward to `ex.worker`. An attempt that fails before any byte reached the client
        goes to another worker, never one tried already, after a jittered pause that doubles
        each time; the last attempt relays (or reports) whatever it gets, unless a fallback
        is left (routing.fallbacks): then its failure, or a timeout on any attempt, moves
        the request on and nothing is sent."""
        retries = max(0, min(self.config.retries, len(workers) - 1))
        ex.send = self.cache_check.watch(ex)  # checks a cache-aware policy's prediction
        others = workers  # narrowed to the untried only on a retry: no copy per request
        for attempt in range(retries + 1):
            ex.trace.worker_id = ex.worker.id
            ex.may_retry = attempt < retries
            ex.attempts = attempt + 1
            if ex.explain is not None:  # listed before the answer's headers go out
                step = {"worker": ex.worker.name, "moved_on": None}
                ex.explain["attempts"].append(step)
            reason = await self._attempt(ex)
            if reason is None:
                return
            if ex.explain is not None:
                step["moved_on"] = reason
            if not ex.may_retry or reason == "timeout":  # only with a fallback left
                ex.fall_back_reason = reason
                return
            self.metrics.retries[reason] += 1
            failed = ex.worker.id
            others = tuple(w for w in others if w.id != failed)
            backoff = self.config.retry_backoff * (2 ** (attempt + 1) - 1)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            worker = ex.policy.select(others, ex.request, self.loads)
            if worker is None:
                return await self._no_worker(ex, model, reason)
            ex.worker = worker

    async def _attempt(self, ex: Exchange) -> str | None:
        """One attempt on `ex.worker`, counted in flight and told to its policy. Returns why
        to try another worker, or None once the client has its answer (or its error)."""
        worker, policy, request = ex.worker, ex.policy, ex.request
        # LoadBoard.started, inlined: the policies' loads move with this router's own count.
        worker_id, loads = worker.id, self.loads
        self.inflight[worker_id] += 1
        loads[worker_id] = loads.get(worker_id, 0) + 1
        if (push := self.push) is not None:
            push.changed(worker_id)
        policy.on_request_start(worker, request)
        ex.ok = ex.released = False
        try:
            return await self._forward_watching_client(ex)
        finally:
            if not ex.released:
                self._release(worker_id)
            policy.on_request_complete(worker, request, ex.ok)

    def _release(self, worker_id: int) -> None:
        self.inflight[worker_id] -= 1
        loads = self.loads
        loads[worker_id] = loads.get(worker_id, 0) - 1
        if self.push is not None:
            self.push.changed(worker_id)

    async def _forward_watching_client(self, ex: Exchange) -> str | None:
        """Run the forward while watching for the client leaving; if it leaves, cancel the
        forward, which closes the upstream connection instead of finishing the generation."""
        task = asyncio.current_task()
        assert task is not None
        ex.answered = ex.client_gone = False
        watcher = asyncio.create_task(_watch_disconnect(ex, task))
        try:
            return await self._forward(ex)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
            return None
        finally:
            ex.answered = True
            watcher.cancel()

    async def _forward(self, ex: Exchange) -> str | None:
        session = self._session or await self._lazy_session()
        scope, worker = ex.scope, ex.worker
        url = worker.url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        # An alias's answer is renamed on the way back, which needs it uncompressed.
        drop = _REQUEST_DROP if ex.rewriter is None else _REQUEST_DROP_REWRITING
        if worker.upstream_authorization is None:
            headers = _request_headers(scope["headers"], drop)
        else:
            headers = _request_headers(scope["headers"], _DROP_FOR_KEYED_WORKER[drop])
            headers.append(("Authorization", worker.upstream_authorization))
        try:
            upstream = await session.request(
                scope["method"], url, data=ex.body, headers=headers, allow_redirects=False
            )
        except TimeoutError as exc:
            self._failed_before_response(worker, "timeout", exc)
            # Only a connection that was never made is safe to try elsewhere: a worker that
            # took the request and stayed silent may still be generating it. A fallback may
            # take either (the connection is closed, so vLLM aborts it): the client has
            # nothing yet, and the other model is another pool.
            connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
            if (ex.may_retry and connecting) or ex.fallbacks:
                return "connect_timeout" if connecting else "timeout"
            await _reject(ex, 504, f"worker {worker.name} did not answer in time")
            return None
        except aiohttp.ClientError as exc:
            kind = _connection_error_kind(exc)
            self._failed_before_response(worker, kind, exc)
            if ex.may_retry or ex.fallbacks:
                return kind
            await _reject(ex, 502, f"worker {worker.name} is unreachable: {exc}")
            return None
        # Status first: an answer that is no failure costs no more than before.
        if upstream.status in RETRY_STATUSES and (ex.may_retry or ex.fallbacks):
            self.metrics.upstream_error(worker.id, f"upstream_{upstream.status}")
            if upstream.status >= 500:
                self.ejector.failure(worker.id, f"answered {upstream.status}")
            upstream.close()
            return f"status_{upstream.status}"
        try:
            await self._relay(ex, upstream)
            return None
        finally:
            if ex.client_gone or not upstream.content.at_eof():
                upstream.close()  # the connection is mid-message: never reuse it
            else:
                upstream.release()

    async def _relay(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> None:
        worker, trace = ex.worker, ex.trace
        status = upstream.status
        if status >= 500:
            self.metrics.upstream_error(worker.id, "upstream_5xx")
            self.ejector.failure(worker.id, f"answered {status}")
        rewriter = _usable_rewriter(ex.rewriter, upstream)
        headers = _response_headers(upstream.raw_headers, rewriter is not None)
        headers.append((access_log.HEADER, trace.request_id))
        if ex.explain is not None:
            headers.append((explain.HEADER, explain.encode(ex.explain)))
        await ex.send({"type": "http.response.start", "status": status, "headers": headers})
        trace.status = status
        push = self.push
        try:
            if push is not None and push.active:
                tell = partial(self._release_telling, ex, push)
                if rewriter is None:
                    await _relay_body_telling(ex, upstream.content, tell)
                else:
                    await _relay_body_renamed(ex, upstream.content, rewriter, tell)
            elif rewriter is None:
                await _relay_body(ex, upstream.content)
            else:
                await _relay_body_renamed(ex, upstream.content, rewriter)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("stream from %s broke: %r", worker.name, exc)
            self.metrics.upstream_error(worker.id, "broken_stream")
            self.ejector.failure(worker.id, f"stream broke: {type(exc).__name__}")
            await _end_broken_stream(ex, upstream, exc)
            return
        if status < 500:
            self.ejector.success(worker.id)
        ex.answered = True
        if push is not None and push.active and not ex.released:
            await self._release_telling(ex, push)
        await ex.send({"type": "http.response.body", "body": b"", "more_body": False})
        ex.ok = status < 500

    async def _release_telling(self, ex: Exchange, push: LoadPush) -> None:
        ex.released = True
        self._release(ex.worker.id)
        await push.delivered()

    def _failed_before_response(self, worker: WorkerView, kind: str, exc: BaseException) -> None:
        self.metrics.upstream_error(worker.id, kind)
        self.ejector.failure(worker.id, f"{kind}: {type(exc).__name__}")
        # Only what says "the server is not there": a malformed answer or a bad URL is not
        # something a health check should act on.
        if isinstance(exc, TimeoutError | aiohttp.ClientConnectionError):
            cause = f"{kind}: {type(exc).__name__}: {exc}"[:_CAUSE_MAX_CHARS]
            entry = self.passive_failures.get(worker.id)
            if entry is None:
                self.passive_failures[worker.id] = [1, cause]
            else:
                entry[0] += 1
                entry[1] = cause


def _refusal_message(ticket: Ticket, model: str) -> str:
    if ticket.refused == "shed":
        return (
            f"`{model}` is at capacity and `sheddable` requests are shed first; retry shortly "
            "(see Retry-After) or send this request at a higher priority class"
        )
    return f"too many requests in flight for `{model}`; retry shortly"


async def _receive_body(ex: Exchange, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await ex.receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _reject(ex, 413, f"the request body exceeds {limit} bytes")
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _watch_disconnect(ex: Exchange, forward: asyncio.Task[Any]) -> None:
    while True:
        message = await ex.receive()
        if message["type"] == "http.disconnect":
            if not ex.answered:
                ex.client_gone = True
                forward.cancel()
            return


async def _relay_body(ex: Exchange, content: aiohttp.StreamReader) -> None:
    send = ex.send
    # The first chunk apart, so the loop below carries no time-to-first-byte check.
    if chunk := await content.readany():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ex.first_byte()
    while chunk := await content.readany():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _relay_body_telling(
    ex: Exchange, content: aiohttp.StreamReader, before_done: Callable[[], Awaitable[None]]
) -> None:
    """The relay while other routers are live: a stream's last event (``data: [DONE]``)
    leaves only after `before_done` (the worker's slot given back and the other routers
    told, routing.load_push), so the client's next request, through any router, finds the
    slot free."""
    first = True
    while chunk := await content.readany():
        if chunk.endswith(_SSE_DONE) and not ex.released:
            await before_done()
        await ex.send({"type": "http.response.body", "body": chunk, "more_body": True})
        if first:
            ex.first_byte()
            first = False


async def _relay_body_renamed(
    ex: Exchange,
    content: aiohttp.StreamReader,
    rewriter: ModelNameRewriter,
    before_done: Callable[[], Awaitable[None]] | None = None,
) -> None:
    send = ex.send
    first = True
    while chunk := await content.readany():
        if first:
            ex.first_byte()
            first = False
        if out := rewriter.feed(chunk):
            if before_done is not None and out.endswith(_SSE_DONE) and not ex.released:
                await before_done()
            await send({"type": "http.response.body", "body": out, "more_body": True})
    if rest := rewriter.flush():
        if before_done is not None and rest.endswith(_SSE_DONE) and not ex.released:
            await before_done()
        await send({"type": "http.response.body", "body": rest, "more_body": True})


async def _end_broken_stream(
    ex: Exchange, upstream: aiohttp.ClientResponse, exc: BaseException
) -> None:
    """Headers are gone already; the honest ending is vLLM's own in-stream error event."""
    if upstream.content_type == "text/event-stream":
        message = f"worker {ex.worker.name} failed mid-stream: {type(exc).__name__}"
        event = sse_error_event(message, path=ex.scope["path"])
        await ex.send({"type": "http.response.body", "body": event, "more_body": True})
    await ex.send({"type": "http.response.body", "body": b"", "more_body": False})


def _usable_rewriter(
    rewriter: ModelNameRewriter | None, upstream: aiohttp.ClientResponse
) -> ModelNameRewriter | None:
    """Only JSON and SSE carry a `model` field, and only uncompressed bytes can be renamed."""
    if rewriter is None or upstream.headers.get("Content-Encoding", "identity") != "identity":
        return None
    kind = upstream.content_type
    return rewriter if kind in ("application/json", "text/event-stream") else None


async def _reject(
    ex: Exchange,
    status: int,
    message: str,
    param: str | None = None,
    *,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A router-made error on a model route, counted under the status it sends, in the
    shape of the route's family (OpenAI's, or Anthropic's on /v1/messages)."""
    ex.trace.status = status
    headers = [*(extra_headers or ()), (access_log.HEADER, ex.trace.request_id)]
    path = ex.scope["path"]
    await respond_error(ex.send, status, message, param, extra_headers=headers, path=path)


def _new_session(config: RouterConfig) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=config.max_connections_per_worker,
        keepalive_timeout=30,
        ttl_dns_cache=60,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=max(config.pool_timeout, config.connect_timeout),
        sock_connect=config.connect_timeout,
        sock_read=config.read_timeout,
    )
    # auto_decompress=False and no automatic headers: the client gets exactly the
    # bytes the worker sent, encoded the way the client asked for.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def _probe_health(session: aiohttp.ClientSession, url: str) -> tuple[bool, str]:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200, f"/health {r.status}"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return False, f"/health failed: {type(exc).__name__}"


def _tune_garbage_collector() -> None:
    """Every proxied request allocates a few hundred short-lived objects, which makes the
    default collector run its young generation hundreds of times a second. Moving what
    start-up built out of the collector's sight and collecting the young generation less
    often cut the router's CPU per request measurably (see bench/RESULTS.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)


def _connection_error_kind(exc: aiohttp.ClientError) -> str:
    # ClientConnectorError: the connection was never made (refused, no route, DNS);
    # anything else failed on a connection that was made (reset, closed, garbled head).
    return "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "reset"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _headers_size(headers: Iterable[tuple[bytes, bytes]]) -> int:
    return sum(len(name) + len(value) for name, value in headers)


def _request_headers(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes] = _REQUEST_DROP
) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.lower() not in drop]


def _response_headers(
    raw: Iterable[tuple[bytes, bytes]], renamed: bool = False
) -> list[tuple[bytes, bytes]]:
    # A renamed body may change length: it goes out chunked, without the worker's length.
    drop = _RESPONSE_DROP_RENAMED if renamed else RESPONSE_DROP
    return [(k, v) for k, v in raw if k.lower() not in drop]
