"""routing.errors: an error the router makes takes its route family's shape (Anthropic's on
/v1/messages, OpenAI's elsewhere), whole and as a broken stream's last event."""

from __future__ import annotations

import orjson
import pytest

from routing.errors import route_error_body, sse_error_event

pytestmark = pytest.mark.django_db(transaction=True)


def test_error_shapes_follow_the_route_family() -> None:
    anthropic_busy = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert orjson.loads(route_error_body("/v1/messages", 503, "busy")) == anthropic_busy
    counted = orjson.loads(route_error_body("/v1/messages/count_tokens", 429, "slow down"))
    assert counted["error"]["type"] == "rate_limit_error"
    for path in ("/v1/chat/completions", "/v1/messages/render", "/v1/messagesx", ""):
        error = orjson.loads(route_error_body(path, 404, "no", "model"))["error"]
        assert error == {"message": "no", "type": "NotFoundError", "param": "model", "code": 404}
    # A stream that broke mid-way ends with the route's own error event.
    event = sse_error_event("worker w failed mid-stream", path="/v1/messages")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert orjson.loads(event.split(b"data: ", 1)[1])["error"]["type"] == "api_error"
    assert sse_error_event("boom").startswith(b'data: {"error":')
