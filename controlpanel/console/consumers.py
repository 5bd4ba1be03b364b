"""The dashboard's websocket: staff only, same origin only, one handler per event type."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from controlpanel.console import live

REFUSED_ANONYMOUS = 4401
REFUSED_ORIGIN = 4403


def same_origin(scope: dict[str, Any]) -> bool:
    """A page from another site must not read the fleet through a logged-in browser."""
    headers = dict(scope.get("headers", []))
    origin = headers.get(b"origin", b"").decode("latin-1")
    host = headers.get(b"host", b"").decode("latin-1")
    return bool(origin) and bool(host) and urlsplit(origin).netloc == host


class FleetConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=REFUSED_ANONYMOUS)
            return
        if not same_origin(self.scope):
            await self.close(code=REFUSED_ORIGIN)
            return
        await self.channel_layer.group_add(live.GROUP, self.channel_name)
        live.publisher.subscribers += 1
        self.subscribed = True
        await self.accept()
        await self.send(text_data=await database_sync_to_async(live.full_message)())

    async def disconnect(self, code: int) -> None:
        if getattr(self, "subscribed", False):
            live.publisher.subscribers -= 1
            await self.channel_layer.group_discard(live.GROUP, self.channel_name)

    async def fleet_update(self, event: dict[str, Any]) -> None:
        await self.send(text_data=event["text"])
