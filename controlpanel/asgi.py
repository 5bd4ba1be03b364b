"""The one ASGI application: the bare router for /v1 and seed paths, Django for the rest,
Channels for websockets, and a lifespan that owns the router's session and refresher."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any

# httpx's package imports its command line client (httpx._main: rich, pygments) whenever
# those are installed, as in a development environment: ~5 MiB of a router process for a
# command no server runs. None in sys.modules makes that import fail as if they were not
# installed, which httpx expects (it then defines a stub `httpx.main`); the admin API's
# calls through httpx are unaffected.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

from django.core.asgi import get_asgi_application  # noqa: E402 - after the line above

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
django_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402 - needs Django set up first
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.urls import path  # noqa: E402

from controlpanel.console.consumers import FleetConsumer  # noqa: E402
from controlpanel.console.live import publisher  # noqa: E402
from controlpanel.routers.snapshot import DatabaseSnapshotSource  # noqa: E402
from routing.asgi_types import Receive, Scope, Send  # noqa: E402
from routing.refresher import SnapshotRefresher  # noqa: E402
from routing.router import RouterApp  # noqa: E402
from routing.routes import routes_here  # noqa: E402
from routing.state import RouterConfig  # noqa: E402

log = logging.getLogger(__name__)

websocket_urlpatterns: list[Any] = [path("ws/fleet/", FleetConsumer.as_asgi())]


def router_config() -> RouterConfig:
    return RouterConfig(
        connect_timeout=settings.ROUTER_CONNECT_TIMEOUT,
        pool_timeout=settings.ROUTER_POOL_TIMEOUT,
        read_timeout=settings.ROUTER_READ_TIMEOUT,
        max_body_bytes=settings.MAX_BODY_BYTES,
        body_timeout=settings.ROUTER_BODY_TIMEOUT,
        require_api_key=settings.CONTROLPANEL_REQUIRE_API_KEY,
        max_connections=settings.ROUTER_MAX_CONNECTIONS,
        max_connections_per_worker=settings.ROUTER_MAX_CONNECTIONS_PER_WORKER,
        retries=settings.ROUTER_RETRIES,
        retry_backoff=settings.ROUTER_RETRY_BACKOFF,
        eject_after=settings.ROUTER_EJECT_AFTER,
        eject_cooldown=settings.ROUTER_EJECT_COOLDOWN,
        max_inflight_per_worker=settings.ROUTER_MAX_INFLIGHT_PER_WORKER,
        queue_timeout=settings.ROUTER_QUEUE_TIMEOUT,
        queue_max=settings.ROUTER_QUEUE_MAX,
        redis_url=settings.REDIS_URL,
        load_report_max_age=settings.ROUTER_LOAD_REPORT_MAX_AGE,
        load_push=settings.ROUTER_LOAD_PUSH,
        kv_index_max_blocks=settings.ROUTER_KV_INDEX_MAX_BLOCKS,
        session_sources=settings.ROUTER_SESSION_SOURCES,
    )


class ControlPanelApp:
    """Path dispatch ahead of Django: router paths never touch Django's middleware."""

    def __init__(self) -> None:
        self.router = RouterApp(router_config())
        self.refresher = SnapshotRefresher(
            self.router,
            DatabaseSnapshotSource(),
            poll_interval=settings.ROUTER_SNAPSHOT_POLL_SECONDS,
            idle_poll_interval=settings.ROUTER_SNAPSHOT_IDLE_POLL_SECONDS,
        )
        self.channels = ProtocolTypeRouter(
            {
                "http": django_app,
                "websocket": AllowedHostsOriginValidator(
                    AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
                ),
            }
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" and routes_here(scope["path"]):
            await self.router(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.channels(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.router.startup()
                    await self.refresher.start()
                    await publisher.start()
                except Exception as exc:
                    log.exception("router start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await publisher.stop()  # bounded on its own
                await stop_within("the snapshot refresher", self.refresher.stop())
                await stop_within("the router", self.router.shutdown())
                await send({"type": "lifespan.shutdown.complete"})
                return


# How long each shutdown step may take. The supervisor (launcher.supervisor) kills a router
# STOP_MARGIN_SECONDS (5) after its streams' grace; a step stuck on the database or Redis
# must not use that margin up, or the router dies with its last usage and deregistration
# unwritten *and* no word of which step hung.
STOP_STEP_SECONDS = 2.0


async def stop_within(what: str, step: Coroutine[Any, Any, None]) -> None:
    """Run one shutdown step for at most STOP_STEP_SECONDS; past that, log it by name and
    leave it behind (asyncio.wait, not wait_for, which would wait for the cancel too)."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=STOP_STEP_SECONDS)
    if not done:
        task.cancel()
        log.warning("%s did not stop within %.0f s; left behind", what, STOP_STEP_SECONDS)
    elif not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("%s failed to stop cleanly", what, exc_info=exc)


application = ControlPanelApp()
