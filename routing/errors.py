"""OpenAI-format error bodies: clients and SDKs parse these, never an HTML page."""

from __future__ import annotations

from typing import Any

import orjson

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


def error_body(status: int, message: str, *, param: str | None = None) -> bytes:
    payload: dict[str, Any] = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
    return orjson.dumps(payload)


def sse_error_event(message: str, status: int = 502) -> bytes:
    """The last event of a stream that broke after it started, as vLLM itself sends it."""
    return b"data: " + error_body(status, message) + b"\n\n"
