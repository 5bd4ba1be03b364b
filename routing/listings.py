"""The router's paths that are not proxied: the model and worker listings, /health, /metrics,
and the 404s and 405s of its other paths.

None of these is on the hot path (routing.proxy sends only the model routes there), so
clarity wins over speed here. Every answer still carries a request id and leaves an
access-log line, and a bug is answered like any other error: JSON, with that id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

import orjson

from routing.admission.auth import OPEN_PATHS, Refusal, visible_models
from routing.asgi_types import Message, Scope, Send
from routing.exchange import Exchange
from routing.fleet.client_keys import ClientKey
from routing.fleet.snapshot import Snapshot
from routing.responses import refuse, respond, respond_error
from routing.telemetry import access_log
from routing.telemetry.counters import CONTENT_TYPE
from routing.telemetry.metrics import CollectedFamilies, render

if TYPE_CHECKING:
    from routing.state import RouterState

log = logging.getLogger(__name__)

SEED_ROUTES = frozenset({"/list_models", "/list_workers", "/health"})
METRICS_PATH = "/metrics"
GET_ROUTES = SEED_ROUTES | {"/v1/models", METRICS_PATH}
_METRICS_CONTENT_TYPE = CONTENT_TYPE.encode()
# Sent on these answers (never on the proxied model routes), for request-loop detection.
DEPLOYMENT_HEADER = b"x-controlpanel-deployment"


async def answer(app: RouterState, scope: Scope, send: Send) -> None:
    """One request on a router path that is not a model route, logged whatever happens."""
    trace = Exchange(scope, _no_receive, send, perf_counter())
    rid = access_log.request_id(trace)
    send = _with_request_id(send, trace, app.snapshot.deployment.encode())
    try:
        await _route(app, trace, send)
    except Exception:
        if trace.status:
            raise  # mid-answer: only uvicorn can end the connection now
        # A bug, answered like any other error (JSON, with the request id to find it by).
        shown = rid.decode("ascii")
        log.exception("router %s %s failed (request %s)", scope["method"], scope["path"], shown)
        await respond_error(send, 500, f"internal error; see the router log for {shown}")
    finally:
        if access_log.enabled():
            access_log.write(trace, "")


async def _route(app: RouterState, ex: Exchange, send: Send) -> None:
    scope = ex.scope
    path = scope["path"]
    method = scope["method"]
    if method != "GET":
        if path in GET_ROUTES or path.startswith("/v1/models/"):
            return await respond_error(send, 405, f"{method} is not allowed on {path}")
        return await respond_error(send, 404, f"no route {path}", path=path)
    client: ClientKey | None = None
    if app.config.require_api_key and path not in OPEN_PATHS:
        checked = app.gate.authenticate(scope, app.snapshot.api_keys)
        if isinstance(checked, Refusal):
            return await refuse(send, checked)
        client = ex.client = checked
    if path == "/v1/models":
        snapshot = app.snapshot
        payload = visible_models(snapshot.models_payload, snapshot.model_entries, client)
        return await respond(send, 200, payload)
    if path.startswith("/v1/models/"):
        return await _model_detail(app, send, path.removeprefix("/v1/models/"), client)
    if path == "/list_models":
        return await respond(send, 200, app.snapshot.list_models_payload)
    if path == "/list_workers":
        return await respond(send, 200, orjson.dumps(_worker_listing(app)))
    if path == "/health":
        return await respond(send, 200, orjson.dumps(health_report(app)))
    if path == METRICS_PATH:
        body = await _metrics_page(app)
        return await respond(send, 200, body, content_type=_METRICS_CONTENT_TYPE)
    await respond_error(send, 404, f"no route {path}", path=path)


async def _model_detail(app: RouterState, send: Send, model: str, client: ClientKey | None) -> None:
    """GET /v1/models/{id}, which the SDKs' models.retrieve() calls. The ASGI path is
    already percent-decoded, so ids with a slash (`org/model`) work as they are."""
    entry = app.snapshot.model_entries.get(model)
    if entry is None or (client is not None and not client.allows(model)):
        return await respond_error(send, 404, f"The model `{model}` does not exist.", "model")
    await respond(send, 200, orjson.dumps(entry))


async def _metrics_page(app: RouterState) -> bytes:
    # Collected here, on the loop, because it reads live dicts; written out on a thread,
    # because a big fleet's text takes tens of ms, a stall every request would feel.
    collected = CollectedFamilies(app.registry.collect())
    return await asyncio.to_thread(render, collected)


def worker_listing(
    snapshot: Snapshot,
    inflight: Mapping[int, int],
    kv_events: Callable[[int], dict[str, Any] | None] = lambda worker_id: None,
    load: Callable[[int], Mapping[str, int | None]] = lambda worker_id: {},
) -> dict[str, Any]:
    """/list_workers: every worker the snapshot knows, with this router's in-flight count,
    the parts of its fused load (`load`: routing.fleet.load_signal's describe) and its KV event
    stream and index (`kv_events`, None without an endpoint)."""
    now = time.time()
    workers = [
        {
            "id": w.id,
            "name": w.name,
            "url": w.url,
            "state": w.state,
            "source": w.source,
            "role": w.role,
            "routable": w.routable,
            "models": [m.id for m in w.models],
            "inflight": inflight.get(w.id, 0),
            "queue_length": w.queue_length,
            "heartbeat_age_s": _rounded(w.heartbeat_age(now)),
            "running": w.running,
            "waiting": w.waiting,
            "kv_cache_usage": w.kv_cache_usage,
            "prefix_hit_rate": w.prefix_hit_rate,
            "metrics_age_s": _rounded(w.metrics_age),
            "kv_block_size": w.kv_block_size,  # vllm:cache_config_info's (None: not read)
            "kv_events": kv_events(w.id),
            **load(w.id),
        }
        for w in snapshot.workers
    ]
    return {"workers": workers}


def health_report(app: RouterState) -> dict[str, Any]:
    """/health: degraded while the snapshot cannot be refreshed or Redis is down."""
    snapshot, store = app.snapshot, app.store
    counts: dict[str, int] = defaultdict(int)
    for worker in snapshot.workers:
        counts[worker.state] += 1
    redis_error = store.error if store is not None else None
    return {
        "status": "degraded" if app.snapshot_error or redis_error else "ok",
        "workers": dict(counts),
        "routable_workers": sum(1 for w in snapshot.workers if w.routable),
        "snapshot_generation": snapshot.generation,
        "snapshot_age_s": round(time.time() - snapshot.built_at, 3),
        "snapshot_error": app.snapshot_error,
        "redis": "not configured" if store is None else redis_error or "ok",
        # Routing state shared with the other routers (routing.peers.fleet_sync); local while down.
        "shared_state": app.sync.status() if app.sync is not None else None,
        "inflight": sum(app.inflight.values()),
        # Each tokenizer folder a model names (kv_aware's local tokens): loaded, loading, or
        # why it cannot be used (the worker's /tokenize serves meanwhile).
        "tokenizers": app.tokens.status(),
        # How each kv_aware model gets its token ids: local, render, tokenize (or worker:
        # its hop has not run yet).
        "tokenize_sources": app.tokens.sources(snapshot),
        # previous_response_id's records (routing.peers.response_affinity): held in memory,
        # looked up in Redis, refused while Redis could not be asked.
        "responses": app.responses.status(),
    }


def _worker_listing(app: RouterState) -> dict[str, Any]:
    return worker_listing(
        app.snapshot, app.inflight, app.kv_events.worker_status, app.board.describe
    )


async def _no_receive() -> Message:
    """The router's own routes never read a body."""
    return {"type": "http.disconnect"}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _with_request_id(send: Send, trace: Exchange, deployment: bytes) -> Send:
    """`send` for these answers: each carries the request's id and the deployment's
    identity, and its status goes in `trace` for the access log. The control plane reads
    the identity when a worker is added (controlpanel.fleet.discovery): a URL that answers
    with its own deployment is one of its routers, and routing to it would loop."""

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            trace.status = message["status"]
            headers = [*message["headers"], (access_log.HEADER, trace.request_id)]
            if deployment:
                headers.append((DEPLOYMENT_HEADER, deployment))
            message["headers"] = headers
        await send(message)

    return send_with_id
