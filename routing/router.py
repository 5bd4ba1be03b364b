"""The router: one ASGI application in front of many vLLM servers, and its lifetime.

:class:`RouterApp` is the router's state (routing.state) plus what happens once per
process: start-up (the one upstream session, the shared state, the KV event streams),
shutdown, the probes that readmit ejected workers, the status it reports (/health,
/list_workers, /metrics), and the ASGI entry that sends model routes to the request path
(routing.proxy) and every other path to routing.listings.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import aiohttp

from routing import listings
from routing.asgi_types import Receive, Scope, Send
from routing.clients import read_timer
from routing.peers import response_affinity
from routing.proxy import Proxy
from routing.routes import MODEL_ROUTES
from routing.state import RouterConfig, RouterState
from routing.telemetry import explain
from routing.telemetry.metrics import render

GC_GEN0_THRESHOLD = 20_000


class RouterApp(RouterState):
    """The ASGI callable for router paths. `snapshot` is swapped by the refresher."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        super().__init__(config)
        self.proxy = Proxy(self, self.startup)
        # Set by every request, cleared by the refresher at each tick: an idle router's
        # refresher sleeps longer, and the first request wakes it (routing.refresher).
        self.request_seen = asyncio.Event()

    # --- status ---------------------------------------------------------------------------

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
        if self.session is None:
            self.session = _new_session(self.config)
            if self.sync is not None:
                await self.sync.start()
            await self.kv_events.start()
            await self.responses.start()
        _tune_garbage_collector()

    async def shutdown(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        self.tokens.close()
        if self.sync is not None:
            await self.sync.stop()
        if self.store is not None:
            await self.store.close()
        await self.kv_events.stop()
        await self.responses.stop()

    async def readmit_due(self) -> None:
        """Probe the workers whose ejection cool-down is over; readmit those that answer."""
        due = self.ejector.due_for_probe()
        if not due:
            return
        if self.session is None:  # a server that skipped the lifespan
            await self.startup()
        assert self.session is not None
        by_id = {w.id: w for w in self.snapshot.workers}
        for worker_id in due:
            worker = by_id.get(worker_id)
            if worker is None:
                self.ejector.probed(worker_id, False, "left the fleet")
                continue
            healthy, detail = await _probe_health(self.session, worker.url)
            self.ejector.probed(worker_id, healthy, detail)

    # --- ASGI entry -----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.request_seen.is_set():
            self.request_seen.set()
        if scope["path"] in MODEL_ROUTES:
            return await self.proxy.handle(scope, receive, send)
        if scope["path"].startswith(response_affinity.BY_ID_PREFIX):  # GET, cancel by id
            return await self.proxy.handle(scope, receive, send, by_id=True)
        await listings.answer(self, scope, send)


def _new_session(config: RouterConfig) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=config.max_connections_per_worker,
        keepalive_timeout=30,
        ttl_dns_cache=60,
    )
    read_timer.install(connector)  # sock_read without a new loop timer per socket read
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
