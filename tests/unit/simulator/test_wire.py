"""simulator.wire: vLLM's error shapes, JSON bodies, request ids and the delay hook."""

from __future__ import annotations

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from simulator.wire import (
    ApiError,
    delay_s,
    error_response,
    parse_body,
    request_id,
    validation_error,
)


def body_of(response: object) -> dict[str, object]:
    return orjson.loads(response.body)  # type: ignore[attr-defined]


def test_an_api_error_answers_in_the_openai_shape_typed_by_status() -> None:
    response = ApiError(404, "no such model", "model").response()
    assert response.status == 404 and response.content_type == "application/json"
    assert body_of(response) == {
        "error": {
            "message": "no such model",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert ApiError(418, "x").err_type == "Error"
    assert body_of(error_response(500, "boom", "SimulatedError"))["error"]["param"] is None


def test_a_validation_error_names_the_parameter_and_the_value() -> None:
    exc = validation_error("too long", "max_tokens", 1025)
    assert (exc.status, exc.param) == (400, "max_tokens")
    assert exc.message == "too long (parameter=max_tokens, value=1025)"
    assert validation_error("bad", "stream_options").message == "bad (parameter=stream_options)"


def test_malformed_json_is_refused_with_the_offset_python_finds() -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(b'{"a": 1,}')
    assert (caught.value.param, caught.value.err_type) == ("body.8", "Bad Request")
    with pytest.raises(ApiError) as caught:
        parse_body(b'{"a": NaN}')  # json accepts it, orjson does not
    assert caught.value.param == "body.0"
    with pytest.raises(ApiError, match="must be a JSON object"):
        parse_body(b"[1, 2]")
    assert parse_body(b'{"model": "m"}') == {"model": "m"}


def test_the_delay_header_in_seconds_never_negative_nor_fatal() -> None:
    def delay(value: str | None) -> float:
        headers = {} if value is None else {"X-Sim-Delay-Ms": value}
        return delay_s(make_mocked_request("POST", "/", headers=headers))

    assert delay("250") == 0.25
    assert delay(None) == delay("") == delay("-5") == delay("soon") == 0.0


def test_request_ids_come_from_the_client_or_are_random() -> None:
    given = make_mocked_request("POST", "/", headers={"X-Request-Id": "abc"})
    assert request_id(given, "chatcmpl") == "chatcmpl-abc"
    a, b = (request_id(make_mocked_request("POST", "/"), "cmpl") for _ in range(2))
    assert a.startswith("cmpl-") and len(a) == len("cmpl-") + 32 and a != b
