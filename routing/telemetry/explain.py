"""Routing explained: why a request went where it went, per request, as a dry run, and live.

* **Per request.** A request with ``X-Route-Explain: 1`` gets an ``X-Route-Explain`` response
  header: compact JSON with the model asked for and the alias target, the policy and its
  decision (prefix, load, miss, affinity, overflow, kv, pending, fallback, turn, weighted,
  two_choices), the session (a hash of its key and its header, routing.sessions), the
  chosen worker, up to 8 candidates with the numbers the policy used
  (load; matched prefix bytes; session rank; KV usage and score; weight; admission room),
  and the attempts (each retry, and why it moved on), with `fallbacks` (from, to, reason)
  when the request moved on to another model or alias (routing.fleet.fallbacks). Allowed when
  client keys are off, and for keys with the explain permission; otherwise the header is
  ignored, not an error. The value stays under MAX_HEADER_BYTES (candidates are dropped
  from the end to fit).
* **Zero cost when not asked.** The proxy notes the header in its one pass over the
  request's headers (routing.telemetry.access_log); only then does it ask the policy's read-only
  `explain` before `select`, so the candidates are what the decision saw.
* **A dry run.** `dry_run` answers the same explanation for a request body without
  forwarding anything or changing any state: the policy's `explain`, never `select` (the
  admin API's ``POST /api/route/explain`` calls it in the router process serving it).
* **Recent decisions.** `DecisionRing` keeps each model's last RING_SIZE decisions of this
  router process (time, worker, decision, attempts, status; the explanation too when the
  request asked for one); routing.peers.fleet_sync publishes it so every router's ring can be
  merged (the models page).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from routing.fleet.snapshot import ModelRoute, WorkerView
from routing.policies.base import BasePolicy, RequestInfo
from routing.sessions import Session, key_of

if TYPE_CHECKING:
    from routing.fleet.client_keys import ClientKey
    from routing.telemetry.router_view import RouterView

T = TypeVar("T")
HEADER = b"x-route-explain"
SCOPE_KEY = "controlpanel.explain"
MAX_CANDIDATES = 8
MAX_HEADER_BYTES = 4000  # under 4 KiB with the header's name


def wanted(value: bytes) -> bool:
    return value.strip().lower() in (b"1", b"true", b"yes")


def allowed(client: ClientKey | None, require_api_key: bool) -> bool:
    """Open to all while client keys are off; otherwise to keys with the permission."""
    if not require_api_key:
        return True
    return client is not None and client.explain


def start(
    *,
    asked: str,
    model: str,
    route: ModelRoute,
    policy: BasePolicy,
    told_candidates: list[dict[str, Any]],
    admission: Mapping[int, bool] | None,
    session: Session | None = None,
) -> dict[str, Any]:
    """The explanation before the decision: what the policy saw, and the session it
    placed (a hash of its key, and its header: routing.sessions)."""
    candidates = told_candidates[:MAX_CANDIDATES]
    if admission is not None:
        names = {w.name: w.id for w in route.workers}
        for row in candidates:
            room = admission.get(names.get(row["worker"], -1))
            row["admission"] = "room" if room else "full"
    return {
        "model": asked,
        "target": model if model != asked else None,
        "policy": policy.name,
        "decision": None,
        "worker": None,
        "candidates": candidates,
        "attempts": [],
        "session": None if session is None else session.shown(),
    }


def carry_over(before: Mapping[str, Any], after: dict[str, Any]) -> None:
    """A fallback's explanation keeps the tries before it and the moves (routing.fleet.fallbacks):
    `attempts` lists every try's workers in order, `fallbacks` where each move went."""
    if "fallbacks" in before:
        after["attempts"] = [*before["attempts"], *after["attempts"]]
        after["fallbacks"] = before["fallbacks"]
    if "prefill" in before:  # routing.pd: the prefill leg's worker, or why it was bypassed
        after["prefill"] = before["prefill"]


def decided(explanation: dict[str, Any], decision: str, worker: WorkerView | None) -> None:
    explanation["decision"] = decision
    explanation["worker"] = worker.name if worker is not None else None


def encode(explanation: Mapping[str, Any]) -> bytes:
    """Compact JSON under MAX_HEADER_BYTES: candidates, then attempts' detail, go first."""
    body = dict(explanation)
    value = orjson.dumps(body)
    candidates = list(body.get("candidates", ()))
    while len(value) > MAX_HEADER_BYTES and candidates:
        candidates.pop()
        body["candidates"], body["truncated"] = candidates, True
        value = orjson.dumps(body)
    if len(value) > MAX_HEADER_BYTES:
        body["attempts"] = body.get("attempts", [])[-3:]
        value = orjson.dumps(body)[:MAX_HEADER_BYTES]
    return value


def dry_run(
    app: RouterView, payload: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]]
) -> dict[str, Any]:
    """What the router would do with this body now, changing nothing (no select, no
    counters, no prefix credit, nothing forwarded)."""
    asked = payload.get("model")
    if not isinstance(asked, str) or not asked:
        raise ValueError("the request body needs a `model`")
    model = asked
    session = app.sessions.read(headers, payload)
    alias = app.snapshot.aliases.get(asked)
    if alias is not None:
        target = alias.choose(key_of(session))
        if target is None:
            raise LookupError(f"the alias `{asked}` has no target")
        model = target
    route = app.snapshot.routes.get(model)
    policy = app.route_policies().get(model)
    if route is None or policy is None:
        raise LookupError(f"The model `{model}` does not exist.")
    text = None
    if policy.needs_request_text:
        from routing.policies.request_text import request_text

        text = request_text(payload)
    # Tokens only as a local tokenizer makes them: a dry run sends nothing to a worker.
    tokens = app.tokens.local_only(route, payload) if policy.needs_request_tokens else None
    request = RequestInfo(model, payload, headers, text, tokens, key_of(session))
    workers = app.ejector.routable(route.workers)
    told = policy.explain(workers, request, app.loads)
    explanation = start(
        asked=asked, model=model, route=route, policy=policy,
        told_candidates=told.candidates, admission=app.admission_room(route, workers),
        session=session,
    )  # fmt: skip
    explanation["decision"] = told.decision if workers else "no_worker"
    explanation["worker"] = told.worker.name if told.worker is not None else None
    explanation["dry_run"] = True
    if route.prefill:  # disaggregated (routing.pd): the prefill leg's choice by this policy
        prefill = app.ejector.routable(route.prefill)
        leg = policy.explain(prefill, request, app.loads)
        explanation["prefill"] = {
            "decision": leg.decision if prefill else "no_worker",
            "worker": leg.worker.name if leg.worker is not None else None,
            "candidates": leg.candidates[:MAX_CANDIDATES],
            "bypass_below_tokens": route.pd_bypass_tokens,
        }
    return explanation


_local: tuple[weakref.ref[RouterView], asyncio.AbstractEventLoop] | None = None


def register_local(app: RouterView) -> None:
    """The router of this process and its event loop, for the admin API's dry run and the
    models page, which Django serves on other threads."""
    global _local
    _local = (weakref.ref(app), asyncio.get_running_loop())


def on_router(read: Callable[[RouterView], T], timeout: float = 5.0) -> T | None:
    """Run `read` on the router's own event loop (its state is not thread-safe) and return
    what it returns; None when this process serves no router (a command, Celery)."""
    app, loop = (_local[0](), _local[1]) if _local is not None else (None, None)
    if app is None or loop is None or loop.is_closed():
        return None
    try:
        if asyncio.get_running_loop() is loop:
            return read(app)
    except RuntimeError:
        pass  # no loop in this thread: the usual case, a Django view's thread

    async def run() -> T:
        return read(app)

    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)
