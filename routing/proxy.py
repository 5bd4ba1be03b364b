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
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from routing import access_log
from routing.admission import Admission
from routing.aliases import ModelNameRewriter, rewrite_request_model, session_key
from routing.auth import OPEN_PATHS, ClientGate, ClientKey, Refusal, visible_models
from routing.ejection import Ejector
from routing.errors import error_body, sse_error_event
from routing.metrics import (
    CONTENT_TYPE,
    CollectedFamilies,
    RequestTrace,
    RouterCollector,
    RouterMetrics,
    render,
)
from routing.policies import make_policy
from routing.policies.base import BasePolicy, RequestInfo
from routing.request_text import request_text
from routing.shared_store import SharedStore
from routing.snapshot import ModelRoute, Snapshot, WorkerView
from routing.usage import ask_for_usage

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Routes forwarded by the `model` field of their JSON body.
MODEL_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
        "/rerank",
        "/score",
        "/pooling",
        "/classify",
    }
)
SEED_ROUTES = frozenset({"/list_models", "/list_workers", "/health"})
METRICS_PATH = "/metrics"
GET_ROUTES = SEED_ROUTES | {"/v1/models", METRICS_PATH}
# vLLM's administrative and dev-mode endpoints: answered here with a 404 so that no client
# can ever put a worker to sleep or reset its cache through the public router.
PRIVATE_ROUTES = frozenset(
    {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/pause",
        "/resume",
        "/is_paused",
        "/update_weights",
        "/scale_elastic_ep",
        "/server_info",
        "/invocations",
    }
)

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

_JSON = b"application/json"
_METRICS_CONTENT_TYPE = CONTENT_TYPE.encode()


GC_GEN0_THRESHOLD = 20_000
_CAUSE_MAX_CHARS = 500


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
    redis_url: str = ""  # shared rate limits and their health (routing.shared_store)


def routes_here(path: str) -> bool:
    """True for every path the router serves; everything else goes to Django."""
    return (
        path.startswith("/v1/")
        or path in MODEL_ROUTES
        or path in SEED_ROUTES
        or path in PRIVATE_ROUTES
        or path == METRICS_PATH
    )


class RouterApp:
    """The ASGI callable for router paths. `snapshot` is swapped by the refresher."""

    # Fleet gauges are the same in every replica; the control plane leaves this True on one
    # live router only, so they are not counted once per router (see routing/metrics.py).
    exports_fleet_metrics: bool = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.snapshot: Snapshot = Snapshot.empty()
        self.snapshot_error: str | None = None
        self.inflight: defaultdict[int, int] = defaultdict(int)
        self.started_at = time.time()
        self.metrics = RouterMetrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RouterCollector(self))
        # worker id -> [failures, last cause]: connection refused or reset, or no answer in
        # time, seen by real traffic; the refresher takes them for the control plane.
        self.passive_failures: dict[int, list[Any]] = {}
        self.store = SharedStore(self.config.redis_url) if self.config.redis_url else None
        self.gate = ClientGate(self.store)  # client keys, rate limits, usage (routing.auth)
        self.ejector = Ejector(self.config.eject_after, self.config.eject_cooldown)
        self.admission = Admission(
            self.config.max_inflight_per_worker, self.config.queue_timeout, self.config.queue_max
        )
        self._session: aiohttp.ClientSession | None = None
        self._policies: dict[tuple[str, str, bytes], BasePolicy] = {}
        self._route_policies: dict[str, BasePolicy] = {}

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

    def route_policies(self) -> Mapping[str, BasePolicy]:
        """The policy instance deciding for each model now (for /metrics)."""
        return self._route_policies

    def take_passive_failures(self) -> dict[int, tuple[int, str]]:
        """The failures seen since the last call, as worker id -> (count, last cause)."""
        taken, self.passive_failures = self.passive_failures, {}
        return {worker_id: (count, cause) for worker_id, (count, cause) in taken.items()}

    def render_metrics(self) -> bytes:
        return render(self.registry)

    async def _metrics_page(self) -> bytes:
        # Collected here, on the loop, because it reads live dicts; written out on a thread,
        # because a big fleet's text takes tens of ms, a stall every request would feel.
        collected = CollectedFamilies(self.registry.collect())
        return await asyncio.to_thread(render, collected)

    # --- lifecycle ------------------------------------------------------------------------

    async def startup(self) -> None:
        if self._session is None:
            self._session = self._new_session()
        _tune_garbage_collector()

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.store is not None:
            await self.store.close()

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections,
            limit_per_host=self.config.max_connections_per_worker,
            keepalive_timeout=30,
            ttl_dns_cache=60,
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=max(self.config.pool_timeout, self.config.connect_timeout),
            sock_connect=self.config.connect_timeout,
            sock_read=self.config.read_timeout,
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

    # --- ASGI entry -----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in MODEL_ROUTES:
            return await self._proxy(scope, receive, send)
        # Every other answer carries a request id and leaves an access-log line too.
        trace = RequestTrace(perf_counter())
        rid = trace.request_id = access_log.request_id(scope)
        send = _with_request_id(send, trace)
        try:
            await self._answer(scope, send)
        except Exception:
            if trace.status:
                raise  # mid-answer: only uvicorn can end the connection now
            # A bug, answered like any other error (JSON, with the request id to find it by).
            shown = rid.decode("ascii")
            log.exception("router %s %s failed (request %s)", scope["method"], scope["path"], shown)
            await _respond_error(send, 500, f"internal error; see the router log for {shown}")
        finally:
            if access_log.enabled():
                access_log.write(scope, trace, rid, "")

    async def _answer(self, scope: Scope, send: Send) -> None:
        """The listings, /health, /metrics, and the 404s and 405s of the router's paths."""
        path = scope["path"]
        method = scope["method"]
        if method != "GET":
            if path in GET_ROUTES or path.startswith("/v1/models/"):
                return await _respond_error(send, 405, f"{method} is not allowed on {path}")
            return await _respond_error(send, 404, f"no route {path}")
        client: ClientKey | None = None
        if self.config.require_api_key and path not in OPEN_PATHS:
            checked = self.gate.authenticate(scope, self.snapshot.api_keys)
            if isinstance(checked, Refusal):
                return await _refuse(send, checked)
            client = checked
        if path == "/v1/models":
            snapshot = self.snapshot
            payload = visible_models(snapshot.models_payload, snapshot.model_entries, client)
            return await _respond(send, 200, payload)
        if path.startswith("/v1/models/"):
            return await self._model_detail(send, path.removeprefix("/v1/models/"), client)
        if path == "/list_models":
            return await _respond(send, 200, self.snapshot.list_models_payload)
        if path == "/list_workers":
            return await _respond(send, 200, orjson.dumps(self.list_workers()))
        if path == "/health":
            return await _respond(send, 200, orjson.dumps(self.health()))
        if path == METRICS_PATH:
            body = await self._metrics_page()
            return await _respond(send, 200, body, content_type=_METRICS_CONTENT_TYPE)
        await _respond_error(send, 404, f"no route {path}")

    async def _model_detail(self, send: Send, model: str, client: ClientKey | None) -> None:
        """GET /v1/models/{id}, which the SDKs' models.retrieve() calls. The ASGI path is
        already percent-decoded, so ids with a slash (`org/model`) work as they are."""
        entry = self.snapshot.model_entries.get(model)
        if entry is None or (client is not None and not client.allows(model)):
            return await _respond_error(send, 404, f"The model `{model}` does not exist.", "model")
        await _respond(send, 200, orjson.dumps(entry))

    # --- the proxy --------------------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One model-route request, counted and timed whatever becomes of it."""
        trace = RequestTrace(perf_counter())
        rid = trace.request_id = access_log.request_id(scope)
        try:
            await self._place(scope, receive, send, trace)
        except Exception:
            trace.status = trace.status or 500  # uvicorn answers an escaped error with a 500
            raise
        finally:
            self.metrics.finish(trace, perf_counter())
            if access_log.enabled():
                access_log.write(scope, trace, rid, self.metrics.worker_label(trace.worker_id))

    async def _place(self, scope: Scope, receive: Receive, send: Send, trace: RequestTrace) -> None:
        """Read, parse, pick a worker and forward; every exit leaves its status in `trace`."""
        method = scope["method"]
        if method != "POST":
            return await _reject(send, trace, 405, f"{method} is not allowed on {scope['path']}")
        client: ClientKey | None = None
        if self.config.require_api_key:  # before the body is read: strangers cost nothing
            checked = self.gate.authenticate(scope, self.snapshot.api_keys)
            if isinstance(checked, Refusal):
                return await _refuse(send, checked, trace)
            client = checked
        if _headers_size(scope["headers"]) > self.config.max_header_bytes:
            limit = self.config.max_header_bytes
            return await _reject(send, trace, 431, f"the request headers exceed {limit} bytes")
        body = await self._read_body(scope, receive, send, trace)
        if body is None:
            return
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return await _reject(send, trace, 400, f"the request body is not valid JSON: {exc}")
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str) or not model:
            return await _reject(
                send, trace, 400, "the request body must be a JSON object with a `model`", "model"
            )
        if client is not None:  # by the name the client asked for, alias or model
            if refusal := await self.gate.admit(client, model):
                return await _refuse(send, refusal, trace)
            if (asked := ask_for_usage(scope["path"], body, payload)) is not None:
                body = asked  # a stream that would go uncounted; the answer is cut to match
            send = self.gate.metered(send, client, model, cut_usage_event=asked is not None)
        await self._route(scope, receive, send, trace, body, payload, model)

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        trace: RequestTrace,
        body: bytes,
        payload: dict[str, Any],
        model: str,
    ) -> None:
        """Resolve an alias, pick a worker by the model's policy and forward."""
        rewriter: ModelNameRewriter | None = None
        alias = self.snapshot.aliases.get(model)
        if alias is not None:
            target = alias.choose(session_key(scope["headers"], payload))
            if target is None:
                return await _reject(send, trace, 503, f"the alias `{model}` has no target")
            body = rewrite_request_model(body, payload, model, target)
            rewriter = ModelNameRewriter(target, model)
            self.metrics.alias_requests[model, target] += 1
            model = target
        route = self.snapshot.routes.get(model)
        policy = self._route_policies.get(model)
        if route is None or policy is None:
            return await _reject(send, trace, 404, f"The model `{model}` does not exist.", "model")
        trace.model = model  # only now: a served name, so the label set stays bounded
        # The prompt as text costs CPU, so only a policy that uses it gets it.
        text = request_text(payload) if policy.needs_request_text else None
        request = RequestInfo(model=model, body=payload, raw_headers=scope["headers"], text=text)
        workers = self.ejector.routable(route.workers)
        if self.admission.limits(route.max_inflight) and workers:
            return await self._admit(scope, receive, send, route, workers, Forward(
                workers[0], body, policy, request, trace, rewriter
            ))  # fmt: skip
        worker = policy.select(workers, request, self.inflight)
        if worker is None:
            return await self._no_worker(send, trace, model)
        forward = Forward(worker, body, policy, request, trace, rewriter)
        await self._forward_with_retries(scope, receive, send, forward, workers, model)

    async def _forward_with_retries(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        forward: Forward,
        workers: Sequence[WorkerView],
        model: str,
    ) -> None:
        forward.trace.worker_id = forward.worker.id
        forward.retries_left = self.config.retries if len(workers) > 1 else 0
        await self._forward_counted(scope, receive, send, forward)
        while forward.retry:
            await self._retry(scope, receive, send, forward, workers, model)

    async def _admit(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: ModelRoute,
        workers: Sequence[WorkerView],
        forward: Forward,
    ) -> None:
        """Forward within the in-flight limits, after a bounded wait; else 429."""
        policy, request = forward.policy, forward.request

        def choose(candidates: Sequence[WorkerView]) -> WorkerView | None:
            return policy.select(candidates, request, self.inflight)

        worker = await self.admission.acquire(
            route.name, workers, route.max_inflight, choose, self.inflight
        )
        if worker is None:
            return await _reject(
                send,
                forward.trace,
                429,
                f"too many requests in flight for `{route.name}`; retry shortly",
                extra_headers=[(b"retry-after", str(self.config.retry_after_seconds).encode())],
            )
        forward.worker = worker
        try:
            await self._forward_with_retries(scope, receive, send, forward, workers, route.name)
        finally:
            self.admission.release(route.name, (m.id for m in worker.models))

    async def _no_worker(self, send: Send, trace: RequestTrace, model: str) -> None:
        await _reject(
            send,
            trace,
            503,
            f"no worker is available for model `{model}` right now",
            extra_headers=[(b"retry-after", str(self.config.retry_after_seconds).encode())],
        )

    async def _retry(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        forward: Forward,
        workers: Sequence[WorkerView],
        model: str,
    ) -> None:
        """Another worker, after a jittered pause, for an attempt that failed before any byte
        reached the client. The last attempt relays (or reports) whatever it gets."""
        forward.retry = False
        forward.tried.add(forward.worker.id)
        forward.retries_left -= 1
        self.metrics.retries[forward.retry_reason] += 1
        backoff = self.config.retry_backoff * (2 ** len(forward.tried) - 1)
        await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
        others = tuple(w for w in workers if w.id not in forward.tried)
        worker = forward.policy.select(others, forward.request, self.inflight) if others else None
        if worker is None:
            return await self._no_worker(send, forward.trace, model)
        if len(others) == 1:
            forward.retries_left = 0
        forward.worker = worker
        forward.trace.worker_id = worker.id
        await self._forward_counted(scope, receive, send, forward)

    async def _read_body(
        self, scope: Scope, receive: Receive, send: Send, trace: RequestTrace
    ) -> bytes | None:
        limit = self.config.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _reject(send, trace, 413, f"the request body exceeds {limit} bytes")
            return None
        try:
            # A client that trickles its body (slowloris) must not hold a request open.
            async with asyncio.timeout(self.config.body_timeout):
                return await self._receive_body(receive, send, trace, limit)
        except TimeoutError:
            seconds = self.config.body_timeout
            await _reject(send, trace, 408, f"the request body did not arrive within {seconds} s")
            return None

    async def _receive_body(
        self, receive: Receive, send: Send, trace: RequestTrace, limit: int
    ) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reject(send, trace, 413, f"the request body exceeds {limit} bytes")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _policy_for(
        self, route: ModelRoute, kept: dict[tuple[str, str, bytes], BasePolicy]
    ) -> BasePolicy:
        """Policies live across snapshot swaps while their configuration is unchanged, so
        stateful ones keep what they learned; unused ones are dropped."""
        key = (route.name, route.policy, orjson.dumps(dict(route.policy_config)))
        policy = self._policies.get(key) or make_policy(route.policy, route.policy_config)
        kept[key] = policy
        return policy

    async def _forward_counted(
        self, scope: Scope, receive: Receive, send: Send, forward: Forward
    ) -> None:
        worker, policy, request = forward.worker, forward.policy, forward.request
        self.inflight[worker.id] += 1
        policy.on_request_start(worker, request)
        ok = False
        try:
            ok = await self._forward_watching_client(scope, receive, send, forward)
        finally:
            self.inflight[worker.id] -= 1
            policy.on_request_complete(worker, request, ok)

    async def _forward_watching_client(
        self, scope: Scope, receive: Receive, send: Send, forward: Forward
    ) -> bool:
        """Run the forward while watching for the client leaving; if it leaves, cancel the
        forward, which closes the upstream connection instead of finishing the generation."""
        task = asyncio.current_task()
        assert task is not None
        state = {"done": False, "gone": False}
        watcher = asyncio.create_task(_watch_disconnect(receive, task, state))
        try:
            return await self._forward(scope, send, forward, state)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
            return False
        finally:
            state["done"] = True
            watcher.cancel()

    async def _forward(
        self, scope: Scope, send: Send, forward: Forward, state: dict[str, bool]
    ) -> bool:
        session = self._session or await self._lazy_session()
        worker, trace = forward.worker, forward.trace
        url = worker.url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        # An alias's answer is renamed on the way back, which needs it uncompressed.
        drop = _REQUEST_DROP if forward.rewriter is None else _REQUEST_DROP_REWRITING
        if worker.upstream_authorization is None:
            headers = _request_headers(scope["headers"], drop)
        else:
            headers = _request_headers(scope["headers"], _DROP_FOR_KEYED_WORKER[drop])
            headers.append(("Authorization", worker.upstream_authorization))
        try:
            upstream = await session.post(
                url, data=forward.body, headers=headers, allow_redirects=False
            )
        except TimeoutError as exc:
            self._failed_before_response(worker, "timeout", exc)
            # Only a connection that was never made is safe to try elsewhere: a worker that
            # took the request and stayed silent may still be generating it.
            if forward.retries_left and isinstance(exc, aiohttp.ConnectionTimeoutError):
                return forward.ask_retry("connect_timeout")
            await _reject(send, trace, 504, f"worker {worker.name} did not answer in time")
            return False
        except aiohttp.ClientError as exc:
            kind = _connection_error_kind(exc)
            self._failed_before_response(worker, kind, exc)
            if forward.retries_left:
                return forward.ask_retry(kind)
            await _reject(send, trace, 502, f"worker {worker.name} is unreachable: {exc}")
            return False
        if forward.retries_left and upstream.status in RETRY_STATUSES:
            self.metrics.upstream_error(worker.id, f"upstream_{upstream.status}")
            if upstream.status >= 500:
                self.ejector.failure(worker.id, f"answered {upstream.status}")
            upstream.close()
            return forward.ask_retry(f"status_{upstream.status}")
        try:
            return await self._relay(send, upstream, forward, state)
        finally:
            if state["gone"] or not upstream.content.at_eof():
                upstream.close()  # the connection is mid-message: never reuse it
            else:
                upstream.release()

    async def _relay(
        self,
        send: Send,
        upstream: aiohttp.ClientResponse,
        forward: Forward,
        state: dict[str, bool],
    ) -> bool:
        worker, trace = forward.worker, forward.trace
        status = upstream.status
        if status >= 500:
            self.metrics.upstream_error(worker.id, "upstream_5xx")
            self.ejector.failure(worker.id, f"answered {status}")
        rewriter = _usable_rewriter(forward.rewriter, upstream)
        headers = _response_headers(upstream.raw_headers, rewriter is not None)
        headers.append((access_log.HEADER, trace.request_id))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        trace.status = status
        try:
            if rewriter is None:
                await _relay_body(send, upstream.content, forward)
            else:
                await _relay_body_renamed(send, upstream.content, forward, rewriter)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("stream from %s broke: %r", worker.name, exc)
            self.metrics.upstream_error(worker.id, "broken_stream")
            self.ejector.failure(worker.id, f"stream broke: {type(exc).__name__}")
            await self._end_broken_stream(send, upstream, worker, exc)
            return False
        if status < 500:
            self.ejector.success(worker.id)
        state["done"] = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return upstream.status < 500

    async def _end_broken_stream(
        self, send: Send, upstream: aiohttp.ClientResponse, worker: WorkerView, exc: BaseException
    ) -> None:
        """Headers are gone already; the honest ending is vLLM's own in-stream error event."""
        if upstream.content_type == "text/event-stream":
            message = f"worker {worker.name} failed mid-stream: {type(exc).__name__}"
            await send(
                {"type": "http.response.body", "body": sse_error_event(message), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

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

    async def _lazy_session(self) -> aiohttp.ClientSession:
        """For servers that skip the ASGI lifespan: make the one session on first use."""
        await self.startup()
        assert self._session is not None
        return self._session

    # --- seed endpoints ---------------------------------------------------------------------

    def list_workers(self) -> dict[str, Any]:
        now = time.time()
        workers = [
            {
                "id": w.id,
                "name": w.name,
                "url": w.url,
                "state": w.state,
                "source": w.source,
                "routable": w.routable,
                "models": [m.id for m in w.models],
                "inflight": self.inflight.get(w.id, 0),
                "queue_length": w.queue_length,
                "heartbeat_age_s": _rounded(w.heartbeat_age(now)),
                "running": w.running,
                "waiting": w.waiting,
                "kv_cache_usage": w.kv_cache_usage,
                "prefix_hit_rate": w.prefix_hit_rate,
                "metrics_age_s": _rounded(w.metrics_age),
            }
            for w in self.snapshot.workers
        ]
        return {"workers": workers}

    def health(self) -> dict[str, Any]:
        counts: dict[str, int] = defaultdict(int)
        for worker in self.snapshot.workers:
            counts[worker.state] += 1
        snapshot_age = time.time() - self.snapshot.built_at
        redis_error = self.store.error if self.store is not None else None
        return {
            "status": "degraded" if self.snapshot_error or redis_error else "ok",
            "workers": dict(counts),
            "routable_workers": sum(1 for w in self.snapshot.workers if w.routable),
            "snapshot_generation": self.snapshot.generation,
            "snapshot_age_s": round(snapshot_age, 3),
            "snapshot_error": self.snapshot_error,
            "redis": "not configured" if self.store is None else redis_error or "ok",
            "inflight": sum(self.inflight.values()),
        }


@dataclass(slots=True)
class Forward:
    """One placed request on its way to its worker."""

    worker: WorkerView
    body: bytes
    policy: BasePolicy
    request: RequestInfo
    trace: RequestTrace
    rewriter: ModelNameRewriter | None = None
    # Retries before the first byte: how many are left, who was tried, and whether the
    # attempt that just ended asks for one (and why).
    retries_left: int = 0
    tried: set[int] = field(default_factory=set)
    retry: bool = False
    retry_reason: str = ""

    def ask_retry(self, reason: str) -> bool:
        self.retry, self.retry_reason = True, reason
        return False

    def first_byte(self) -> None:
        self.trace.first_byte = perf_counter()
        self.policy.on_first_byte(self.worker, self.request)


async def _relay_body(send: Send, content: aiohttp.StreamReader, forward: Forward) -> None:
    # The first chunk apart, so the loop below carries no time-to-first-byte check.
    if chunk := await content.readany():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        forward.first_byte()
    while chunk := await content.readany():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _relay_body_renamed(
    send: Send, content: aiohttp.StreamReader, forward: Forward, rewriter: ModelNameRewriter
) -> None:
    first = True
    while chunk := await content.readany():
        if first:
            forward.first_byte()
            first = False
        if out := rewriter.feed(chunk):
            await send({"type": "http.response.body", "body": out, "more_body": True})
    if rest := rewriter.flush():
        await send({"type": "http.response.body", "body": rest, "more_body": True})


def _usable_rewriter(
    rewriter: ModelNameRewriter | None, upstream: aiohttp.ClientResponse
) -> ModelNameRewriter | None:
    """Only JSON and SSE carry a `model` field, and only uncompressed bytes can be renamed."""
    if rewriter is None or upstream.headers.get("Content-Encoding", "identity") != "identity":
        return None
    kind = upstream.content_type
    return rewriter if kind in ("application/json", "text/event-stream") else None


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


async def _watch_disconnect(
    receive: Receive, forward: asyncio.Task[Any], state: dict[str, bool]
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not state["done"]:
                state["gone"] = True
                forward.cancel()
            return


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


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    *,
    content_type: bytes = _JSON,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers += extra_headers
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _respond_error(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    *,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await _respond(send, status, error_body(status, message, param=param), extra_headers)


async def _reject(
    send: Send,
    trace: RequestTrace,
    status: int,
    message: str,
    param: str | None = None,
    *,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A router-made error on a model route, counted under the status it sends."""
    trace.status = status
    headers = [*(extra_headers or ()), (access_log.HEADER, trace.request_id)]
    await _respond_error(send, status, message, param, extra_headers=headers)


async def _refuse(send: Send, refusal: Refusal, trace: RequestTrace | None = None) -> None:
    """A request turned away by the client gate (routing.auth): 401, 404 or 429."""
    status, headers = refusal.status, list(refusal.headers)
    if trace is not None:
        trace.status = refusal.status
        headers.append((access_log.HEADER, trace.request_id))
    await _respond_error(send, status, refusal.message, refusal.param, extra_headers=headers)


def _with_request_id(send: Send, trace: RequestTrace) -> Send:
    """`send` for the answers of the other routes: each carries the request's id, and its
    status goes in `trace` for the access log."""

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            trace.status = message["status"]
            message["headers"] = [*message["headers"], (access_log.HEADER, trace.request_id)]
        await send(message)

    return send_with_id
