"""Request ids and the access log (routing.telemetry.access_log): the id kept or made, the
one line per request with what happened and nothing of what was asked, and sampling."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from routing.exchange import Exchange
from routing.fleet.client_keys import ClientKey
from routing.sessions import Session
from routing.telemetry import access_log
from routing.telemetry.access_writer import BatchedStreamHandler
from tests.support.exchanges import exchange


def request(*headers: tuple[bytes, bytes], **fields: Any) -> Exchange:
    return exchange(None, *headers, **fields)


def test_a_sensible_client_id_is_kept_and_forwarded_as_it_came() -> None:
    ex = request((b"x-request-id", b"client-42"), (b"x-route-explain", b"1"))
    assert access_log.request_id(ex) == b"client-42" == ex.request_id
    assert ex.scope["headers"].count((b"x-request-id", b"client-42")) == 1
    assert ex.explain_asked  # noted in the same pass over the headers


@pytest.mark.parametrize("sent", [b"", b"x" * 129, b"caf\xc3\xa9", b"tab\there"])
def test_a_missing_or_unfit_id_is_replaced_by_a_new_one_upstream_too(sent: bytes) -> None:
    ex = request((b"x-request-id", sent)) if sent else request()
    made = access_log.request_id(ex)
    assert len(made) == 32 and made != sent and not ex.explain_asked
    assert [v for n, v in ex.scope["headers"] if n == b"x-request-id"] == [made]


def test_one_line_per_request_with_what_happened_and_no_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = ClientKey(id=1, name="team", prefix="cpk_abcdefgh", digest=b"d")
    ex = request(
        request_id=b"r-1", model="m", status=200, first_byte=0.0, client=key,
        session=Session("agent-secret-session", "x-session-id"),
        hops=[{"from": "chat", "to": "m", "reason": "no_worker"}],
        cache={"decision": "prefix", "predicted": 32, "reported": 16, "block_size": 16},
        pd={"worker": "p1", "prefill_seconds": 0.0123, "prefilled_at": 5.0},
    )  # fmt: skip
    ex.body = b'{"messages": [{"content": "the prompt"}]}'
    with caplog.at_level(logging.INFO, logger="routing.access"):
        assert access_log.enabled()
        access_log.write(ex, "w1")
    (record,) = caplog.records
    line = orjson.loads(record.getMessage())
    assert record.status == 200  # type: ignore[attr-defined]
    assert (line["request_id"], line["method"], line["path"]) == (
        "r-1", "POST", "/v1/chat/completions",
    )  # fmt: skip
    assert (line["model"], line["worker"], line["status"], line["key"]) == (
        "m", "w1", 200, "cpk_abcdefgh",
    )  # fmt: skip
    assert line["ttft_ms"] is not None and line["duration_ms"] >= line["ttft_ms"]
    assert line["fallbacks"] == [{"from": "chat", "to": "m", "reason": "no_worker"}]
    assert line["session"]["from"] == "x-session-id"
    assert line["cache"]["predicted"] == 32
    assert line["pd"] == {"worker": "p1", "prefill_ms": 12.3}
    text = record.getMessage()
    assert "agent-secret-session" not in text and "the prompt" not in text


def test_a_line_without_model_worker_or_answer_says_null_and_499(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="routing.access"):
        access_log.write(request(request_id=b"r-2"), "")
    line = orjson.loads(caplog.records[0].getMessage())
    assert (line["model"], line["worker"], line["status"], line["ttft_ms"]) == (
        None, None, 499, None,
    )  # fmt: skip
    assert line["fallbacks"] is None and line["session"] is None and line["pd"] is None


def test_sampling_keeps_a_share_of_successes_and_every_failure() -> None:
    def record(status: object) -> logging.LogRecord:
        made = logging.LogRecord("routing.access", logging.INFO, __file__, 1, "{}", None, None)
        made.status = status
        return made

    none, every = access_log.SampleFilter(0.0), access_log.SampleFilter(1.0)
    assert not none.filter(record(200)) and every.filter(record(200))
    assert none.filter(record(404)) and none.filter(record(502)) and none.filter(record(None))
    half = access_log.SampleFilter(0.5)
    kept = sum(half.filter(record(200)) for _ in range(4000))
    assert 1700 < kept < 2300  # 2000 +- more than 6 sigma (sigma = 32)


@contextlib.contextmanager
def as_configured() -> Iterator[tuple[io.StringIO, access_log.SampleFilter]]:
    """The `routing.access` logger set up as settings.LOGGING sets it up (one batched handler,
    `%(message)s`, SampleFilter, no propagation), in place of pytest's capturing handlers
    (which pytest adds for the test's call, so this runs inside the test)."""
    log = access_log.log
    kept = (list(log.handlers), list(log.filters), log.propagate, log.level)
    stream, sample = io.StringIO(), access_log.SampleFilter(1.0)
    handler = BatchedStreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(sample)
    log.handlers[:], log.filters[:] = [handler], []
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        yield stream, sample
    finally:
        handler.close()
        log.handlers[:], log.filters[:], log.propagate = kept[0], kept[1], kept[2]
        log.setLevel(kept[3])


def test_the_configured_log_gets_its_line_without_a_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_record(*args: Any) -> logging.LogRecord:
        raise AssertionError("a record was made")

    monkeypatch.setattr(access_log, "_record", no_record)
    with as_configured() as (stream, sample):
        handler = access_log.direct_handler()
        assert handler is not None
        access_log.write(request(request_id=b"r-3", status=200), "w1")
        sample.share = 0.0  # successes dropped, failures kept, as through logging
        access_log.write(request(request_id=b"r-4", status=200), "w1")
        access_log.write(request(request_id=b"r-5", status=502), "w1")
        handler.flush()
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["request_id"], line["status"]) for line in lines] == [("r-3", 200), ("r-5", 502)]


@pytest.mark.parametrize("change", ["formatter", "logger filter", "handler filter", "propagate"])
def test_any_other_set_up_gets_the_line_through_logging(change: str) -> None:
    with as_configured() as (stream, _):
        log = access_log.log
        handler = log.handlers[0]
        if change == "formatter":
            handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        elif change == "logger filter":
            log.addFilter(lambda record: True)
        elif change == "handler filter":
            handler.addFilter(lambda record: record.getMessage().startswith("{"))
        else:
            log.propagate = True
        assert access_log.direct_handler() is None
        access_log.write(request(request_id=b"r-6", status=200), "w1")
        handler.flush()
    (line,) = stream.getvalue().splitlines()
    assert '"request_id":"r-6"' in line
    assert line.startswith("INFO ") == (change == "formatter")
