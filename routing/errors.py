"""Error bodies: clients and SDKs parse these, never an HTML page.

One shape for every error the project writes, the router's and the control plane's alike:
    {"error": {"message": ..., "type": ..., "param": ..., "code": <the HTTP status>}}
`error_payload` builds it as a dict, for a framework that renders JSON itself (Django's
JsonResponse, django-ninja); `error_body` serialises it, for the router's bare ASGI.

The one exception is Anthropic's API family (`/v1/messages` and `/v1/messages/count_tokens`,
which vLLM serves for Claude Code and the `anthropic` SDK): there the router's own refusals
take Anthropic's shape, `{"type": "error", "error": {"type": "not_found_error", "message":
...}}`, as do the events that end a stream that broke. `route_error_body` and
`sse_error_event` are the one place that picks the shape by path; nothing is looked up on a
request that is answered by a worker.
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


# Anthropic's API: the paths whose errors take its shape (and any other /v1/messages/...
# path, which the router answers 404). vLLM's /v1/messages/render is not one: it answers in
# vLLM's OpenAI shape, so the router's refusals there do too.
_ANTHROPIC_PREFIX = "/v1/messages"
_OPENAI_SHAPED = "/v1/messages/render"
# Anthropic's error types by status (docs.anthropic.com, "Errors"); the router's 503 (no
# worker, a model at capacity) is Anthropic's overloaded_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "request_too_large",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ANTHROPIC_DEFAULT_TYPE = "api_error"


def is_anthropic(path: str) -> bool:
    """Whether `path` is in Anthropic's API family (its errors in Anthropic's shape)."""
    if not path.startswith(_ANTHROPIC_PREFIX) or path == _OPENAI_SHAPED:
        return False
    return len(path) == len(_ANTHROPIC_PREFIX) or path[len(_ANTHROPIC_PREFIX)] == "/"


def anthropic_error_payload(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape, its type named after `status`."""
    kind = _ANTHROPIC_TYPES.get(status, _ANTHROPIC_DEFAULT_TYPE)
    return {"type": "error", "error": {"type": kind, "message": message}}


def route_error_body(path: str, status: int, message: str, param: str | None = None) -> bytes:
    """The router's own error on `path`, in that route family's shape."""
    if is_anthropic(path):
        return orjson.dumps(anthropic_error_payload(status, message))
    return error_body(status, message, param=param)


def sse_error_event(message: str, status: int = 502, path: str = "") -> bytes:
    """The last event of a stream that broke after it started, as vLLM itself sends it: on
    the OpenAI routes a `data:` event; on Anthropic's, an `event: error` (vLLM's too)."""
    if is_anthropic(path):
        return b"event: error\ndata: " + route_error_body(path, status, message) + b"\n\n"
    return b"data: " + error_body(status, message) + b"\n\n"
