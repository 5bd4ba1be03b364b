"""OpenTelemetry traces (routing.telemetry.tracing), off by default
(tests/unit/routing/telemetry/test_tracing.py): one span per routed request with its
attributes, exported by the SDK's in-memory exporter; the W3C traceparent reaches the
simulated vLLM worker (which records every request's headers); and an OTLP collector that
never answers costs the requests nothing."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from routing.asgi_types import Message
from routing.fleet.snapshot import ModelEntry, WorkerView, build_snapshot
from routing.router import RouterApp
from routing.telemetry.tracing import RequestTracer
from simulator.config import SimConfig
from simulator.server import RunningSimulator, start_simulator

MODEL = "traced-m"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


async def call(app: RouterApp, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> int:
    sent: list[Message] = []
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": headers, "query_string": b""}  # fmt: skip
    await app(scope, receive, send)
    return int(sent[0]["status"])


def routed_app(sim: RunningSimulator, tracer: RequestTracer | None) -> RouterApp:
    app = RouterApp()
    app.tracer = tracer
    worker = WorkerView(id=1, name="gpu-1", url=sim.url, state="active", source="operator",
                        models=(ModelEntry(id=MODEL),), queue_length=None, last_heartbeat=None,
                        routable=True)  # fmt: skip
    aliases = {"traced-alias": {MODEL: 100}}
    app.install(build_snapshot(workers=[worker], served_models=(), generation=1, aliases=aliases))
    return app


def test_one_span_per_request_with_its_attributes_and_the_traceparent_sent_on() -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer.with_processor(SimpleSpanProcessor(exporter))

    async def scenario() -> tuple[list[int], list[dict[str, str]]]:
        sim = await start_simulator(SimConfig(model=MODEL, ttft_ms=1, itl_ms=1))
        try:
            app = routed_app(sim, tracer)
            body = {"model": "traced-alias", "prompt": "hi", "max_tokens": 3}
            statuses = [
                await call(app, body, [(b"traceparent", CLIENT_PARENT.encode())]),
                await call(app, {"model": "nobody-serves-this"}, []),
            ]
            await app.shutdown()
            return statuses, [r["headers"] for r in sim.state.requests]
        finally:
            await sim.stop()

    statuses, received = asyncio.run(scenario())
    assert statuses == [200, 404]
    routed, unknown = exporter.get_finished_spans()
    attributes = dict(routed.attributes or {})
    assert attributes["controlpanel.model"] == attributes["gen_ai.request.model"] == MODEL
    assert attributes["controlpanel.alias"] == "traced-alias"
    assert attributes["controlpanel.policy"] == "shortest_queue"
    assert attributes["controlpanel.worker"] == "gpu-1"
    assert attributes["controlpanel.decision"] == "load"  # shortest_queue's only kind
    assert attributes["controlpanel.retries"] == 0
    assert attributes["http.response.status_code"] == 200
    assert float(attributes["controlpanel.ttfb_ms"]) > 0  # type: ignore[arg-type]
    # The client's trace goes on; the worker gets this span as its parent.
    assert routed.parent is not None and format(routed.context.trace_id, "032x") == CLIENT_TRACE
    (headers,) = received
    sent_on = headers["traceparent"]
    assert sent_on == f"00-{CLIENT_TRACE}-{routed.context.span_id:016x}-01"
    assert dict(unknown.attributes or {})["http.response.status_code"] == 404


# The stuck exporter's timeout: far past any request's time, even on a busy machine (its
# shutdown waits for the export under way, so the test takes this long).
EXPORT_TIMEOUT_S = 5


@pytest.fixture
def silent_collector() -> Iterator[str]:
    """A port that accepts connections and never answers: the worst OTLP collector."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"


def test_a_collector_that_never_answers_neither_blocks_nor_slows_requests(
    silent_collector: str,
) -> None:
    exporter = OTLPSpanExporter(endpoint=silent_collector, timeout=EXPORT_TIMEOUT_S)
    # Export every span at once, so the exporter's thread is stuck on the collector from
    # the first request on, and the small queue is full (spans dropped) soon after.
    processor = BatchSpanProcessor(
        exporter,
        max_queue_size=16,
        max_export_batch_size=1,
        schedule_delay_millis=1,
        export_timeout_millis=500,
    )
    traced = RequestTracer.with_processor(processor)

    async def timed(tracer: RequestTracer, count: int) -> list[float]:
        sim = await start_simulator(SimConfig(model=MODEL, ttft_ms=0, itl_ms=0))
        try:
            app = routed_app(sim, tracer)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            took = []
            for _ in range(count):
                started = time.perf_counter()
                assert await call(app, body, []) == 200
                took.append(time.perf_counter() - started)
            await app.shutdown()
            return took
        finally:
            await sim.stop()

    with_stuck_exporter = asyncio.run(timed(traced, 200))
    exporter.shutdown()  # the queued spans are dropped, not sent one timeout at a time
    traced.shutdown()
    # Every request answered, and none waited for the stuck exporter: one that had would
    # have taken its timeout at least. (How close the traced requests' latency stays to
    # untraced ones' is a speed figure, not this test's to time.)
    assert len(with_stuck_exporter) == 200
    assert max(with_stuck_exporter) < EXPORT_TIMEOUT_S, max(with_stuck_exporter)
