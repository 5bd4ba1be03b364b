"""vLLM's wire conventions shared by every endpoint: JSON bodies, errors in the OpenAI format,
request ids built from ``X-Request-Id``, and the ``X-Sim-Delay-Ms`` test hook."""

from __future__ import annotations

import json
import os
from typing import Any

import orjson
from aiohttp import web

# vLLM names an error's type after its exception class, by status unless told otherwise.
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


class ApiError(Exception):
    """A client error, answered in vLLM's OpenAI error format."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "Error")

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.err_type, self.param)


def validation_error(message: str, parameter: str, value: Any = None) -> ApiError:
    """A 400 as vLLM's VLLMValidationError words it: the parameter (and the value it
    refused) appended to the message, "(parameter=max_tokens, value=1025)"."""
    extras = [f"parameter={parameter}"] + ([] if value is None else [f"value={value}"])
    return ApiError(400, f"{message} ({', '.join(extras)})", parameter)


def error_response(
    status: int, message: str, err_type: str, param: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return json_response(body, status)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        # vLLM (FastAPI) answers malformed JSON with its validation error: type "Bad
        # Request", param "body.<offset of the error>", the offset Python's json module finds.
        try:
            json.loads(body)
            pos = 0  # orjson refused what json accepts (NaN, lone surrogates...)
        except ValueError as exc:
            pos = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
        raise ApiError(400, "JSON decode error", f"body.{pos}", "Bad Request") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return data


def delay_s(request: web.Request) -> float:
    raw = request.headers.get("X-Sim-Delay-Ms")
    if not raw:
        return 0.0
    try:
        return max(0.0, float(raw)) / 1000
    except ValueError:
        return 0.0


def request_id(request: web.Request, prefix: str) -> str:
    # vLLM builds its request id from the client's X-Request-Id when there is one.
    rid = request.headers.get("X-Request-Id") or os.urandom(16).hex()
    return f"{prefix}-{rid}"
