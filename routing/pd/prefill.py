"""The prefill leg: the prompt computed on a prefill worker, its KV cache left for a decode.

The model's own policy chooses the prefill worker (its cached blocks are what matter
there); the leg is one short, whole request whose answer the client never sees, only its
`kv_transfer_params`. A failure before the answer (refused, reset, a 429/502/503) tries
another prefill worker; an answer that is an error (the request is invalid, say) goes to
the client as the worker wrote it; a client that leaves cancels the leg at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any

import aiohttp

from routing.clients.failures import Failure, classify, classify_status
from routing.exchange import Exchange
from routing.fleet.snapshot import WorkerView
from routing.pd.bodies import transfer_params, uncached_tokens
from routing.policies.base import BasePolicy, Choice
from routing.relay import DROP_FOR_KEYED_WORKER, REQUEST_DROP, request_headers, watch_disconnect
from routing.responses import reject, respond
from routing.state import RouterState
from routing.telemetry import access_log, explain

# A prefill answer is one token and its transfer parameters; anything much larger is not one.
MAX_ANSWER_BYTES = 1 << 20
# What run() returns when the chosen prefill worker already holds nearly all the prompt.
BYPASS: dict[str, Any] = {}


class PrefillLeg:
    """Runs prefill legs on the router's state; one per router."""

    def __init__(
        self, state: RouterState, session: Callable[[], Awaitable[aiohttp.ClientSession]]
    ) -> None:
        self.state, self._session = state, session

    async def run(
        self,
        ex: Exchange,
        body: bytes,
        workers: Sequence[WorkerView],
        policy: BasePolicy,
        bypass_below: int = 0,
    ) -> dict[str, Any] | None:
        """The transfer parameters from a prefill worker; BYPASS when the worker the policy
        chose already holds all but fewer than `bypass_below` of the prompt's tokens (its
        cache-aware prediction says so); None once the client has its answer (an error) or
        has left."""
        task = asyncio.current_task()
        assert task is not None
        ex.answered = ex.client_gone = False
        watcher = asyncio.create_task(watch_disconnect(ex, task))
        try:
            return await self._tries(ex, body, workers, policy, bypass_below)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
            return None
        finally:
            watcher.cancel()

    async def _tries(
        self,
        ex: Exchange,
        body: bytes,
        workers: Sequence[WorkerView],
        policy: BasePolicy,
        bypass_below: int,
    ) -> dict[str, Any] | None:
        state, started = self.state, perf_counter()
        pd = ex.pd if ex.pd is not None else {}
        retries = max(0, min(state.config.retries, len(workers) - 1))
        others, reason = workers, "no_worker"
        for attempt in range(retries + 1):
            choice = policy.select(others, ex.request, state.loads)
            if choice.worker is None:
                break
            if attempt == 0 and uncached_tokens(ex.request, choice) < bypass_below:
                return BYPASS
            self._note(ex, pd, choice, attempt)
            outcome = await self._attempt(ex, choice.worker, policy, body)
            if isinstance(outcome, dict):
                pd["prefill_seconds"] = perf_counter() - started
                pd["prefilled_at"] = perf_counter()
                return outcome
            if outcome is None:
                return None  # answered
            reason = outcome.reason
            state.metrics.pd_prefill_failures[ex.model, reason] += 1
            others = tuple(w for w in others if w.id != choice.worker.id)
        message = f"no prefill worker could take the request for model `{ex.model}` ({reason})"
        await reject(ex, 503, message, extra_headers=[(b"retry-after", b"2")])
        return None

    def _note(self, ex: Exchange, pd: dict[str, Any], choice: Choice, attempt: int) -> None:
        assert choice.worker is not None
        pd["prefill_worker"] = choice.worker.name
        pd["prefill_decision"] = choice.decision
        pd["prefill_attempts"] = attempt + 1
        if ex.explain is not None:
            shown = {"worker": choice.worker.name, "decision": choice.decision}
            ex.explain.setdefault("prefill", {}).update(shown, attempts=attempt + 1)

    async def _attempt(
        self, ex: Exchange, worker: WorkerView, policy: BasePolicy, body: bytes
    ) -> dict[str, Any] | Failure | None:
        """One prefill request, counted in flight on its worker and told to its policy."""
        state, request = self.state, ex.request
        state.inflight[worker.id] += 1
        state.loads[worker.id] = state.loads.get(worker.id, 0) + 1
        policy.on_request_start(worker, request)
        ok = False
        try:
            outcome = await self._post(ex, worker, body)
            ok = isinstance(outcome, dict)
            return outcome
        finally:
            state.inflight[worker.id] -= 1
            state.loads[worker.id] = state.loads.get(worker.id, 0) - 1
            policy.on_request_complete(worker, request, ok)

    async def _post(
        self, ex: Exchange, worker: WorkerView, body: bytes
    ) -> dict[str, Any] | Failure | None:
        state, scope = self.state, ex.scope
        headers = request_headers(scope["headers"], _drop(worker))
        if worker.upstream_authorization is not None:
            headers.append(("Authorization", worker.upstream_authorization))
        headers.append(("Content-Type", "application/json"))
        session = await self._session()
        try:
            async with session.post(worker.url + scope["path"], data=body, headers=headers) as r:
                if (failure := classify_status(r.status)) is not None:
                    state.failures.record(worker.id, failure)
                    return failure
                answer = await r.content.read(MAX_ANSWER_BYTES)
                status = r.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = classify(exc)
            state.failures.record(worker.id, failure, exc)
            return failure
        if status != 200:  # the worker's own error (an invalid request): the client's answer
            ex.status = status
            headers_out = [(access_log.HEADER, ex.request_id)]
            if ex.explain is not None:
                headers_out.append((explain.HEADER, explain.encode(ex.explain)))
            await respond(ex.send, status, answer, headers_out)
            return None
        state.ejector.success(worker.id)
        params = transfer_params(answer)
        if params is None:
            message = (f"prefill worker {worker.name} answered without kv_transfer_params: is it "
                       "started with --kv-transfer-config and kv_role kv_producer?")  # fmt: skip
            await reject(ex, 502, message)
        return params


def _drop(worker: WorkerView) -> frozenset[bytes]:
    # The prefill body is the router's own JSON: the client's length and encoding do not fit.
    drop = REQUEST_DROP | {b"content-type", b"accept-encoding"}
    return drop | DROP_FOR_KEYED_WORKER[REQUEST_DROP] if worker.upstream_authorization else drop
