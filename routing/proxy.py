"""The request path: one model-route request, from its first byte in to its last byte out.

Per request it reads the body once, parses it once (only to learn `model`), admits it,
picks a worker from the in-memory snapshot, forwards the untouched bytes over the one
long-lived aiohttp session and relays the answer chunk by chunk as it arrives. No ORM, no
Django, no buffer. Two edits it makes, both spliced into the bytes: an alias's target name
in place of the alias (routing.fleet.aliases, renamed back in the answer), and, for a
client key's stream that did not ask for usage, `stream_options.include_usage`
(routing.admission.usage, its extra chunk cut from the answer) so that streaming is no
way around token accounting. A client that goes away cancels the upstream request at
once, so vLLM frees its KV cache.

What a request did is kept on its one routing.exchange.Exchange; what outlives it on the
router's state (routing.state), which routing.router owns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any

import aiohttp
import orjson

from routing import response_pinning
from routing.admission.admission import Ticket, refusal_message
from routing.admission.auth import Refusal
from routing.admission.usage import ask_for_usage
from routing.asgi_types import Receive, Scope, Send
from routing.exchange import Exchange
from routing.fleet import fallbacks
from routing.fleet.aliases import ModelNameRewriter, rewrite_request_model
from routing.fleet.priority import HEADER as PRIORITY_HEADER
from routing.fleet.priority import UnknownClass, request_rank
from routing.fleet.snapshot import ModelRoute, WorkerView
from routing.forward import Forwarder
from routing.pd.route import Disaggregation
from routing.peers import response_affinity
from routing.policies.base import NO_WORKER, Choice, RequestInfo
from routing.policies.request_text import request_text
from routing.relay import (
    header,
    headers_size,
    receive_body,
)
from routing.responses import refuse, reject
from routing.sessions import key_of
from routing.state import RouterState
from routing.telemetry import access_log, explain

log = logging.getLogger(__name__)


class Proxy:
    """The model routes of one router: `handle` runs one request on the router's state.

    The parts of the state that never change after start-up are read once, here; the
    snapshot, the policies and the tracer are read from the state per request."""

    def __init__(self, state: RouterState, start: Callable[[], Awaitable[None]]) -> None:
        self.state, self._start = state, start
        self.config = state.config
        self.metrics, self.ejector = state.metrics, state.ejector
        self.admission, self.gate, self.sessions = state.admission, state.gate, state.sessions
        self.inflight, self.loads = state.inflight, state.loads
        self.tokens, self.responses, self.decisions = state.tokens, state.responses, state.decisions
        self.pd = Disaggregation(state, self._session)
        self.forwarder = Forwarder(state, self._session, self._no_worker)

    async def _session(self) -> aiohttp.ClientSession:
        """The one upstream session; a server that skipped the ASGI lifespan starts it here."""
        if self.state.session is None:
            await self._start()
        assert self.state.session is not None
        return self.state.session

    async def handle(self, scope: Scope, receive: Receive, send: Send, by_id: bool = False) -> None:
        """One model-route request, counted and timed whatever becomes of it."""
        ex = Exchange(scope, receive, send, perf_counter())
        access_log.request_id(ex)
        tracer = self.state.tracer
        span = tracer.start(scope) if tracer is not None else None
        try:
            await (self._place_by_id(ex) if by_id else self._place(ex))
        except Exception:
            ex.status = ex.status or 500  # uvicorn answers an escaped error with a 500
            raise
        finally:
            self._record(ex, span)

    def _record(self, ex: Exchange, span: Any) -> None:
        """The request's end, told once: metrics, the span, the decisions ring, the log."""
        metrics = self.metrics
        metrics.finish(ex, perf_counter())
        tracer = self.state.tracer
        if span is not None and tracer is not None:
            tracer.end(span, ex, metrics.worker_label)
        if ex.decision:
            worker = metrics.worker_label(ex.worker_id) if ex.attempts else None
            self.decisions.add(ex.model, worker, ex.decision, ex.attempts, ex.status, ex.explain)
        if access_log.enabled():
            access_log.write(ex, metrics.worker_label(ex.worker_id))

    # --- arrival: who is asking, for what -------------------------------------------------

    async def _place(self, ex: Exchange) -> None:
        """Read, parse, admit the client, then route; every exit leaves its status on `ex`."""
        scope = ex.scope
        method = scope["method"]
        if method != "POST":
            return await reject(ex, 405, f"{method} is not allowed on {scope['path']}")
        if self.config.require_api_key:  # before the body is read: strangers cost nothing
            checked = self.gate.authenticate(scope, self.state.snapshot.api_keys)
            if isinstance(checked, Refusal):
                return await refuse(ex.send, checked, ex, path=scope["path"])
            ex.client = checked
        if headers_size(scope["headers"]) > self.config.max_header_bytes:
            limit = self.config.max_header_bytes
            return await reject(ex, 431, f"the request headers exceed {limit} bytes")
        client = ex.client
        try:
            ex.rank, capped = request_rank(
                header(scope, PRIORITY_HEADER), client.priority if client else None
            )
        except UnknownClass as exc:
            return await reject(ex, 400, str(exc), "x-priority")
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
            return await reject(ex, 400, f"the request body is not valid JSON: {exc}")
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str) or not model:
            return await reject(
                ex, 400, "the request body must be a JSON object with a `model`", "model"
            )
        if client is not None:  # by the name the client asked for, alias or model
            if refusal := await self.gate.admit(client, model):
                return await refuse(ex.send, refusal, ex, path=scope["path"])
            if (asked := ask_for_usage(scope["path"], body, payload)) is not None:
                body = asked  # a stream that would go uncounted; the answer is cut to match
            ex.send = self.gate.metered(ex.send, client, model, cut_usage_event=asked is not None)
        ex.body = body
        ex.session = self.sessions.read(scope["headers"], payload)
        if scope["path"] == response_affinity.PATH:  # the one check other routes pay
            ex.send = self.responses.catch_ids(ex, payload)
            if (previous := response_affinity.previous_id(payload)) is not None:
                found = await self.responses.find(previous)
                if isinstance(found, response_affinity.Unreachable):
                    return await response_pinning.refuse_unreachable(ex, found)
                ex.pinned = found
                ex.pinned_shown = (
                    found.shown() if found else {"response_id": previous, "found_in": None}
                )
        if ex.explain_asked and explain.allowed(client, self.config.require_api_key):
            ex.explain = {}  # filled in by _route once the model's route is known
        await self._route(ex, payload, model)

    async def _read_body(self, ex: Exchange) -> bytes | None:
        limit = self.config.max_body_bytes
        declared = header(ex.scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await reject(ex, 413, f"the request body exceeds {limit} bytes")
            return None
        # A client that trickles its body (slowloris) must not hold a request open. What
        # asyncio.timeout does, by hand: one timer and no Timeout object, a few µs less on
        # every request (#29).
        task = asyncio.current_task()
        assert task is not None
        expired: list[bool] = []
        cancelling = task.cancelling()

        def expire() -> None:
            expired.append(True)
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.config.body_timeout, expire)
        try:
            return await receive_body(ex, limit)
        except asyncio.CancelledError:
            if not expired or task.uncancel() > cancelling:  # cancelled by someone else too
                raise
        finally:
            timer.cancel()
        seconds = self.config.body_timeout
        await reject(ex, 408, f"the request body did not arrive within {seconds} s")
        return None

    async def _place_by_id(self, ex: Exchange) -> None:
        """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: to the holder only."""
        worker = await response_pinning.place_by_id(self.state, ex)
        if worker is not None:
            await self.forwarder.forward(ex, (worker,), ex.model)

    # --- where it goes --------------------------------------------------------------------

    async def _route(self, ex: Exchange, payload: dict[str, Any], model: str) -> None:
        """Resolve an alias, pick a worker by the model's policy (after admission, where the
        model has in-flight limits) and forward. A name with fallbacks goes through
        _route_falling_back, which comes back here for each try."""
        snapshot = self.state.snapshot
        alias = snapshot.aliases.get(model)
        if alias is not None:
            if alias.fallbacks and ex.hops is None:
                return await self._route_falling_back(ex, payload, model, alias.fallbacks)
            target = alias.choose(key_of(ex.session))
            if ex.pinned is not None:  # the target whose worker holds the response
                target = response_pinning.alias_target(ex.pinned, alias, target)
            if target is None:
                return await reject(ex, 503, f"the alias `{model}` has no target")
            ex.body = rewrite_request_model(ex.body, payload, model, target)
            # Named back to what the client asked for, which a fallback alias is not.
            ex.rewriter = ModelNameRewriter(target, payload["model"])
            self.metrics.alias_requests[model, target] += 1
            model = target
        route = snapshot.routes.get(model)
        policy = self.state.route_policies().get(model)
        if route is None or policy is None:
            if ex.hops:  # a fallback the new snapshot no longer has: the next, or a 503
                return await self._no_worker(ex, model, fallbacks.GONE)
            return await reject(ex, 404, f"The model `{model}` does not exist.", "model")
        # The one check a request without fallbacks pays (an alias's target brings none).
        if route.fallbacks and alias is None and ex.hops is None:
            return await self._route_falling_back(ex, payload, model, route.fallbacks)
        ex.model = model  # only now: a served name, so the label set stays bounded
        if ex.pinned is not None:  # previous_response_id: its holder, or why not
            pinned = response_pinning.pin_route(self.state, ex, route, policy, ex.pinned)
            if isinstance(pinned, response_pinning.Gone):
                return await response_pinning.refuse_gone(ex, pinned, ex.pinned)
            route, policy = pinned
        # The prompt as text costs CPU, so only a policy that uses it gets it.
        text = request_text(payload) if policy.needs_request_text else None
        workers = self.ejector.routable(route.workers)
        tokens = None
        if policy.needs_request_tokens:  # kv_aware only: local tokenizer, or the worker's
            session = await self._session()
            path = ex.scope["path"]
            tokens = await self.tokens.of(session, path, route, payload, workers, self.loads)
        headers = ex.scope["headers"]
        ex.request = RequestInfo(model, payload, headers, text, tokens, key_of(ex.session))
        ex.policy = policy
        if route.prefill and not await self.pd.place(ex, payload, route, policy):
            return  # disaggregated (routing.pd): the prefill leg answered the client
        if ex.explain is not None:  # before select, which may learn from the request
            before = ex.explain
            self._start_explaining(ex, payload["model"], route, workers)
            explain.carry_over(before, ex.explain)  # a fallback's keeps the earlier tries
        admitted = self.admission.limits(route.max_inflight) and bool(workers)
        worker = await (self._admit(ex, route, workers) if admitted else self._select(ex, workers))
        if worker is None:
            return
        ex.worker = worker
        try:
            await self.forwarder.forward(ex, workers, model)
        finally:
            if admitted:
                self.admission.release(route.name, (m.id for m in worker.models), ex.rank)

    def _decided(self, ex: Exchange, choice: Choice | None, refused: str = "") -> None:
        """What the policy decided (or why admission refused), kept on the exchange and in
        its explanation."""
        worker = choice.worker if choice is not None else None
        ex.decision = choice.decision if choice is not None and worker else refused
        ex.prediction = choice.prediction if choice is not None and worker else None
        if ex.explain is not None:
            explain.decided(ex.explain, ex.decision, worker)

    async def _select(self, ex: Exchange, workers: Sequence[WorkerView]) -> WorkerView | None:
        """The policy's pick, without in-flight limits; None once the request was answered
        (503) or handed to its next fallback."""
        choice = ex.policy.select(workers, ex.request, self.loads)
        self._decided(ex, choice, NO_WORKER)
        if choice.worker is None:
            await self._no_worker(ex, ex.model)
        return choice.worker

    async def _admit(
        self, ex: Exchange, route: ModelRoute, workers: Sequence[WorkerView]
    ) -> WorkerView | None:
        """The policy's pick within the in-flight limits, after a bounded wait; None once the
        request was answered (429) or handed to its next fallback."""
        policy, request, loads = ex.policy, ex.request, self.loads
        chosen: list[Choice] = []  # the policy's last choice, once room was found

        def choose(candidates: Sequence[WorkerView]) -> WorkerView | None:
            choice = policy.select(candidates, request, loads)
            chosen[:] = [choice]
            return choice.worker

        ticket = Ticket(ex.rank, ex.flow, ex.weight, route.priority_reserve)
        ticket.session = key_of(ex.session)
        worker = await self.admission.acquire(
            route.name, workers, route.max_inflight, choose, self.inflight, ticket
        )
        self._decided(ex, chosen[0] if worker is not None and chosen else None, ticket.refused)
        if worker is not None:
            return worker
        if ex.fallbacks and ticket.refused != "shed":  # nothing sent: a fallback takes it
            ex.fall_back_reason = fallbacks.SATURATED
            return None
        headers = [(b"retry-after", str(self.config.retry_after_seconds).encode())]
        if ex.explain is not None:
            headers.append((explain.HEADER, explain.encode(ex.explain)))
        await reject(ex, 429, refusal_message(ticket, route.name), extra_headers=headers)
        return None

    async def _route_falling_back(
        self, ex: Exchange, payload: dict[str, Any], asked: str, chain: tuple[str, ...]
    ) -> None:
        """The request for `asked`, then, while a try fails before any byte went out, the next
        fallback the client's key may use (routing.fleet.fallbacks). Each try is a whole
        _route, so admission slots and counts are the try's own and released before the next."""
        ex.fallbacks = fallbacks.usable(chain, ex.client)
        ex.hops = []
        send = ex.send  # each try wraps it for its own policy's cache check
        await self._route(ex, payload, asked)
        while ex.fall_back_reason is not None:
            ex.send = send
            target = ex.move_on(payload, self.metrics.fallbacks)
            await self._route(ex, payload, target)

    def _start_explaining(
        self, ex: Exchange, asked: str, route: ModelRoute, workers: Sequence[WorkerView]
    ) -> None:
        told = ex.policy.explain(workers, ex.request, self.loads)
        ex.explain = explain.start(
            asked=asked, model=route.name, route=route, policy=ex.policy,
            told_candidates=told.candidates, admission=self.state.admission_room(route, workers),
            session=ex.session,
        )  # fmt: skip

    async def _no_worker(self, ex: Exchange, model: str, reason: str = fallbacks.NO_WORKER) -> None:
        if ex.fallbacks:  # nothing sent yet: the next fallback takes it (routing.fleet.fallbacks)
            ex.fall_back_reason = reason
            return
        headers = [(b"retry-after", str(self.config.retry_after_seconds).encode())]
        if ex.explain is not None:
            headers.append((explain.HEADER, explain.encode(ex.explain)))
        what = f"model `{model}`"
        if ex.hops:  # every fallback was tried: name what the client asked for
            what = f"model `{ex.hops[0]['from']}` or any of its fallbacks"
        message = f"no worker is available for {what} right now"
        await reject(ex, 503, message, extra_headers=headers)
