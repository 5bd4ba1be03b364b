"""A request's Exchange (routing.exchange) built in process, with the messages sent to its
client recorded, and a client that stays until told to leave."""

from __future__ import annotations

import asyncio
from typing import Any

from routing.asgi_types import Message
from routing.exchange import Exchange


class Client:
    """The ASGI side of one request: what the router sent it, and `leave()` to hang up."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self._gone = asyncio.Event()

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def receive(self) -> Message:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self._gone.set()

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.sent if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def exchange(
    via: Client | None = None,
    /,
    *headers: tuple[bytes, bytes],
    method: str = "POST",
    path: str = "/v1/chat/completions",
    started: float = 0.0,
    **fields: Any,
) -> Exchange:
    """An exchange for `method path` with `headers` (and host), sent to `via` (a new
    Client when None), its other fields as given (`client` is the caller's key)."""
    via = via or Client()
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(b"host", b"router"), *headers]}  # fmt: skip
    return Exchange(scope, via.receive, via.send, started, **fields)
