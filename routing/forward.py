"""Forwarding: one request to its worker and the answer back, with retries before the
first byte.

The :class:`Forwarder` sends the exchange's bytes to `ex.worker` over the one upstream
session, counts the attempt in flight and tells its policy, watches for the client
leaving, relays the answer (routing.relay) and, when an attempt fails before any byte
reached the client and the failure allows it (routing.clients.failures), tries another
worker chosen by the same policy. Used by the request path (routing.proxy) for every
forwarded request, a disaggregated model's decode leg included.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import aiohttp

from routing.clients.failures import (
    Failure,
    broken_stream,
    classify,
    classify_status,
    relayed_status,
)
from routing.exchange import Exchange
from routing.fleet.snapshot import WorkerView
from routing.peers.load_push import LoadPush
from routing.relay import (
    DROP_FOR_KEYED_WORKER,
    REQUEST_DROP,
    REQUEST_DROP_REWRITING,
    end_broken_stream,
    relay_body,
    relay_body_renamed,
    relay_body_telling,
    request_headers,
    response_headers,
    usable_rewriter,
    watch_disconnect,
)
from routing.responses import reject
from routing.state import RouterState
from routing.telemetry import access_log, explain

log = logging.getLogger(__name__)

# What the request path does when no worker is left to retry on: (ex, model, reason).
NoWorker = Callable[[Exchange, str, str], Awaitable[None]]


class Forwarder:
    def __init__(
        self,
        state: RouterState,
        session: Callable[[], Awaitable[aiohttp.ClientSession]],
        no_worker: NoWorker,
    ) -> None:
        self.state, self._session, self._no_worker = state, session, no_worker
        self.config, self.metrics, self.failures = state.config, state.metrics, state.failures
        self.ejector, self.inflight, self.loads = state.ejector, state.inflight, state.loads
        self.push, self.cache_check = state.push, state.cache_check

    async def forward(self, ex: Exchange, workers: Sequence[WorkerView], model: str) -> None:
        """Forward to `ex.worker`. An attempt that fails before any byte reached the client
        goes to another worker, never one tried already, after a jittered pause that doubles
        each time, when the failure allows it (routing.clients.failures); the last attempt
        relays (or reports) whatever it gets, unless a fallback is left: then its failure
        moves the request on and nothing is sent."""
        retries = max(0, min(self.config.retries, len(workers) - 1))
        ex.send = self.cache_check.watch(ex)  # checks a cache-aware policy's prediction
        others = workers  # narrowed to the untried only on a retry: no copy per request
        for attempt in range(retries + 1):
            ex.worker_id = ex.worker.id
            ex.may_retry = attempt < retries
            ex.attempts = attempt + 1
            if ex.explain is not None:  # listed before the answer's headers go out
                step = {"worker": ex.worker.name, "moved_on": None}
                ex.explain["attempts"].append(step)
            failure = await self._attempt(ex)
            if failure is None:
                return
            if ex.explain is not None:
                step["moved_on"] = failure.reason
            if not ex.may_retry or not failure.retryable:  # only with a fallback left
                ex.fall_back_reason = failure.reason
                return
            self.metrics.retries[failure.reason] += 1
            failed = ex.worker.id
            others = tuple(w for w in others if w.id != failed)
            backoff = self.config.retry_backoff * (2 ** (attempt + 1) - 1)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            worker = ex.policy.select(others, ex.request, self.loads).worker
            if worker is None:
                return await self._no_worker(ex, model, failure.reason)
            if ex.before_retry is not None and not await ex.before_retry(ex):
                return  # its preparation answered the client (routing.pd's new prefill leg)
            ex.worker = worker

    async def _attempt(self, ex: Exchange) -> Failure | None:
        """One attempt on `ex.worker`, counted in flight and told to its policy. Returns why
        to try elsewhere, or None once the client has its answer (or its error)."""
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

    async def _forward_watching_client(self, ex: Exchange) -> Failure | None:
        """Run the forward while watching for the client leaving; if it leaves, cancel the
        forward, which closes the upstream connection instead of finishing the generation."""
        task = asyncio.current_task()
        assert task is not None
        ex.answered = ex.client_gone = False
        watcher = asyncio.create_task(watch_disconnect(ex, task))
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

    async def _forward(self, ex: Exchange) -> Failure | None:
        session = self.state.session or await self._session()
        scope, worker = ex.scope, ex.worker
        url = worker.url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        # An alias's answer is renamed on the way back, which needs it uncompressed.
        drop = REQUEST_DROP if ex.rewriter is None else REQUEST_DROP_REWRITING
        if worker.upstream_authorization is None:
            headers = request_headers(scope["headers"], drop)
        else:
            headers = request_headers(scope["headers"], DROP_FOR_KEYED_WORKER[drop])
            headers.append(("Authorization", worker.upstream_authorization))
        try:
            upstream = await session.request(
                scope["method"], url, data=ex.body, headers=headers, allow_redirects=False
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = classify(exc)
            self.failures.record(worker.id, failure, exc)
            # A fallback may take any failure (the connection is closed, so vLLM aborts the
            # request): the client has nothing yet, and the other model is another pool.
            if (ex.may_retry and failure.retryable) or ex.fallbacks:
                return failure
            if isinstance(exc, TimeoutError):
                await reject(ex, 504, f"worker {worker.name} did not answer in time")
            else:
                await reject(ex, 502, f"worker {worker.name} is unreachable: {exc}")
            return None
        # Status first: an answer that is no failure costs no more than before.
        if (ex.may_retry or ex.fallbacks) and (refused := classify_status(upstream.status)):
            self.failures.record(worker.id, refused)
            upstream.close()
            return refused
        try:
            await self._relay(ex, upstream)
            return None
        finally:
            if ex.client_gone or not upstream.content.at_eof():
                upstream.close()  # the connection is mid-message: never reuse it
            else:
                upstream.release()

    async def _relay(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> None:
        worker = ex.worker
        status = upstream.status
        if (failure := relayed_status(status)) is not None:
            self.failures.record(worker.id, failure)
        rewriter = usable_rewriter(ex.rewriter, upstream)
        headers = response_headers(upstream.raw_headers, rewriter is not None)
        headers.append((access_log.HEADER, ex.request_id))
        if ex.explain is not None:
            headers.append((explain.HEADER, explain.encode(ex.explain)))
        await ex.send({"type": "http.response.start", "status": status, "headers": headers})
        ex.status = status
        push = self.push
        try:
            if push is not None and push.active:
                tell = partial(self._release_telling, ex, push)
                if rewriter is None:
                    await relay_body_telling(ex, upstream.content, tell)
                else:
                    await relay_body_renamed(ex, upstream.content, rewriter, tell)
            elif rewriter is None:
                await relay_body(ex, upstream.content)
            else:
                await relay_body_renamed(ex, upstream.content, rewriter)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("stream from %s broke: %r", worker.name, exc)
            self.failures.record(worker.id, broken_stream(exc))
            await end_broken_stream(ex, upstream, exc)
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
