"""Requests pinned to the worker holding a response's state (routing.peers.response_affinity's ids):
a `/v1/responses` follow-up by its `previous_response_id`, and `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` by their path. The policy that never chooses
(:class:`PinnedPolicy`), whether the holder can still answer (:func:`holder_state`), the
route narrowed to it (:func:`pin_route`), and the refusals when it is gone: an error that
names the response and its worker, never an answer from another worker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from routing.errors import error_body
from routing.fleet.snapshot import ModelRoute, Snapshot, WorkerView
from routing.peers.response_affinity import DECISION, Holder, Unreachable, by_id
from routing.policies.base import BasePolicy, Explanation, RequestInfo
from routing.responses import refuse, respond
from routing.telemetry import access_log, explain

if TYPE_CHECKING:
    from routing.clients.ejection import Ejector
    from routing.exchange import Exchange
    from routing.fleet.aliases import AliasRoute
    from routing.fleet.client_keys import ClientKey
    from routing.state import RouterState


class PinnedPolicy(BasePolicy):
    """The one worker holding a response's state; the model's own policy still hears of
    the request (its load bookkeeping) but does not choose."""

    name = "previous_response_id"
    default_decision = DECISION

    def __init__(self, holder: Holder, inner: BasePolicy | None) -> None:
        super().__init__()
        self.holder, self.inner = holder, inner

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        return next((w for w in workers if w.id == self.holder.worker_id), None)

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        worker = self.pick(workers, request, loads)
        rows = [{"worker": w.name, "load": loads.get(w.id, 0), **self.holder.shown()}
                for w in workers if w is worker]  # fmt: skip
        return Explanation(DECISION, worker, rows)

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        if self.inner is not None:
            self.inner.on_request_start(worker, request)

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        if self.inner is not None:
            self.inner.on_request_complete(worker, request, ok)


@dataclass(frozen=True, slots=True)
class Gone:
    """Why the worker holding a response cannot take this request."""

    status: int
    message: str
    param: str


def holder_state(
    holder: Holder, snapshot: Snapshot, ejector: Ejector, route: ModelRoute | None
) -> WorkerView | Gone:
    """The holder's worker when it may take the request: for a follow-up (`route` given)
    routable and serving the model; for a GET or cancel, still running (draining too)."""
    rid, param = holder.response_id, "previous_response_id" if route else "response_id"
    worker = next((w for w in snapshot.workers if w.id == holder.worker_id), None)
    if worker is None:
        why = f"#{holder.worker_id}, which has left the fleet"
        return Gone(404, _gone(rid, why, "its stored responses are gone with it"), param)
    name = f"`{worker.name}`"
    if route is not None and worker.state == "draining":
        return Gone(404, _gone(rid, f"{name}, which is draining", "it takes no new work"), param)
    if worker.id in ejector.ejected_until or not (worker.routable or worker.state == "draining"):
        state = "ejected after failures" if worker.id in ejector.ejected_until else worker.state
        return Gone(503, _gone(rid, f"{name}, which is {state} now", "retry later"), param)
    if route is not None and all(w.id != worker.id for w in route.workers):
        why = f"{name}, which does not serve `{route.name}` now"
        return Gone(404, _gone(rid, why, "no other worker has its state"), param)
    return worker


def _gone(rid: str, where: str, then: str) -> str:
    return f"Response '{rid}' is held by worker {where}: {then}."


def alias_target(holder: Holder, alias: AliasRoute, drawn: str | None) -> str | None:
    """A follow-up through an alias stays with the target model that holds its state."""
    return holder.model if any(t == holder.model for t, _ in alias.targets) else drawn


def pin_route(
    app: RouterState, ex: Exchange, route: ModelRoute, policy: BasePolicy, holder: Holder
) -> tuple[ModelRoute, BasePolicy] | Gone:
    """The route narrowed to the holder, no fallback (another model has not the state)."""
    worker = holder_state(holder, app.snapshot, app.ejector, route)
    if isinstance(worker, Gone):
        return worker
    ex.fallbacks = ()
    return replace(route, workers=(worker,), fallbacks=()), PinnedPolicy(holder, policy)


async def place_by_id(app: RouterState, ex: Exchange) -> WorkerView | None:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: the holder, to forward to
    (its policy and explanation set on `ex`), or None once the client has its refusal."""
    scope = ex.scope
    path, method = scope["path"], scope["method"]
    found = by_id(path, method)
    if found is None:
        if by_id(path, "GET") or by_id(path, "POST"):
            await _refuse(ex, 405, f"{method} is not allowed on {path}")
        else:
            await _refuse(ex, 404, f"no route {path}")
        return None
    rid, _ = found
    client: ClientKey | None = None
    if app.config.require_api_key:
        from routing.admission.auth import Refusal

        checked = app.gate.authenticate(scope, app.snapshot.api_keys)
        if isinstance(checked, Refusal):
            await refuse(ex.send, checked, ex)
            return None
        client = ex.client = checked
    holder = await app.responses.find(rid)
    ex.pinned_shown = {"response_id": rid, "found_in": None}
    if isinstance(holder, Unreachable):
        await refuse_unreachable(ex, holder, "response_id")
        return None
    if holder is None:  # vLLM's own answer: no model to route by, any worker is a guess
        ex.status = 404
        body = error_body(404, f"Response with id '{rid}' not found.",
                          kind="invalid_request_error", param="response_id")  # fmt: skip
        await respond(ex.send, 404, body, [(access_log.HEADER, ex.request_id)])
        return None
    ex.pinned_shown = holder.shown()
    if ex.explain_asked and explain.allowed(client, app.config.require_api_key):
        ex.explain = {}  # filled once the worker is known
    if client is not None and (refusal := await app.gate.admit(client, holder.model)):
        await refuse(ex.send, refusal, ex)
        return None
    worker = holder_state(holder, app.snapshot, app.ejector, None)
    if isinstance(worker, Gone):
        await _refuse(ex, worker.status, worker.message, worker.param)
        return None
    ex.model = holder.model
    ex.policy = PinnedPolicy(holder, app.route_policies().get(holder.model))
    ex.request = RequestInfo(holder.model, {}, scope["headers"])
    ex.worker, ex.decision = worker, DECISION
    if ex.explain is not None:
        told = ex.policy.explain((worker,), ex.request, app.loads)
        ex.explain = {"model": holder.model, "target": None, "policy": PinnedPolicy.name,
                      "decision": DECISION, "worker": worker.name,
                      "candidates": told.candidates, "attempts": []}  # fmt: skip
    return worker


async def refuse_gone(ex: Exchange, gone: Gone, holder: Holder) -> None:
    """The follow-up's error; its explanation says which response pinned it where."""
    if ex.explain is not None:
        ex.explain = {"model": ex.model, "policy": PinnedPolicy.name,
                      "decision": "holder_gone", "worker": None, **holder.shown()}  # fmt: skip
    await _refuse(ex, gone.status, gone.message, gone.param)


async def refuse_unreachable(
    ex: Exchange, unreachable: Unreachable, param: str = "previous_response_id"
) -> None:
    """A 503 with Retry-After: where the response lives cannot be asked now."""
    await _refuse(ex, 503, unreachable.message(), param)


async def _refuse(ex: Exchange, status: int, message: str, param: str | None = None) -> None:
    ex.status = status
    headers = [(access_log.HEADER, ex.request_id)]
    if status == 503:
        headers.append((b"retry-after", b"2"))
    if ex.explain:
        headers.append((explain.HEADER, explain.encode(ex.explain)))
    await respond(ex.send, status, error_body(status, message, param=param), headers)
