"""Whole answers the router writes itself over ASGI: JSON bodies and errors (OpenAI's shape,
Anthropic's on its routes: `path` picks, routing.errors.route_error_body).

Shared by the proxy's refusals (routing.proxy) and the routes it does not proxy
(routing.listings). Proxied answers never come through here: they are relayed as they arrive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from routing.admission.auth import Refusal
from routing.asgi_types import Send
from routing.errors import route_error_body
from routing.telemetry import access_log

if TYPE_CHECKING:
    from routing.exchange import Exchange

JSON = b"application/json"


async def respond(
    send: Send,
    status: int,
    body: bytes,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    *,
    content_type: bytes = JSON,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers += extra_headers
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_error(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    *,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    path: str = "",
) -> None:
    """An error the router writes itself, in the shape of `path`'s route family."""
    body = route_error_body(path, status, message, param)
    await respond(send, status, body, extra_headers)


async def refuse(
    send: Send, refusal: Refusal, ex: Exchange | None = None, *, path: str = ""
) -> None:
    """A request turned away by the client gate (routing.admission.auth): 401, 404 or 429. With an
    exchange (a model route), the refusal is counted and carries the request id."""
    status, headers = refusal.status, list(refusal.headers)
    if ex is not None:
        ex.status = refusal.status
        headers.append((access_log.HEADER, ex.request_id))
    await respond_error(
        send, status, refusal.message, refusal.param, extra_headers=headers, path=path
    )


async def reject(
    ex: Exchange,
    status: int,
    message: str,
    param: str | None = None,
    *,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A router-made error on a model route, counted under the status it sends, in the
    shape of the route's family (OpenAI's, or Anthropic's on /v1/messages)."""
    ex.status = status
    headers = [*(extra_headers or ()), (access_log.HEADER, ex.request_id)]
    path = ex.scope["path"]
    await respond_error(ex.send, status, message, param, extra_headers=headers, path=path)
