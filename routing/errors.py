"""OpenAI-format error bodies: clients and SDKs parse these, never an HTML page.

One shape for every error the project writes, the router's and the control plane's alike:
    {"error": {"message": ..., "type": ..., "param": ..., "code": <the HTTP status>}}
`error_payload` builds it as a dict, for a framework that renders JSON itself (Django's
JsonResponse, django-ninja); `error_body` serialises it, for the router's bare ASGI.
"""

from __future__ import annotations

from typing import Any

import orjson

# The `type` for a status when the caller names none (routing's own errors).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
_DEFAULT_TYPE = "InternalServerError"


def error_payload(
    status: int, message: str, *, kind: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The error as a dict; `kind` is its `type` field, by default named after `status`."""
    return {
        "error": {
            "message": message,
            "type": kind or _TYPES.get(status, _DEFAULT_TYPE),
            "param": param,
            "code": status,
        }
    }


def error_body(
    status: int, message: str, *, kind: str | None = None, param: str | None = None
) -> bytes:
    """The error as JSON bytes, ready to send."""
    return orjson.dumps(error_payload(status, message, kind=kind, param=param))


def sse_error_event(message: str, status: int = 502) -> bytes:
    """The last event of a stream that broke after it started, as vLLM itself sends it."""
    return b"data: " + error_body(status, message) + b"\n\n"
