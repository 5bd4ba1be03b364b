"""OpenTelemetry traces of routed requests: off by default, on with OTEL_EXPORTER_OTLP_ENDPOINT.

* **Off** (no endpoint, `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`): the router
  holds no tracer, the proxy's only cost is one `is not None` check at a request's start and
  one at its end, and the OpenTelemetry packages are not even imported.
* **On**: one span per model-route request (`router <path>`, kind SERVER), continuing the
  client's W3C `traceparent` when it sent one. The worker gets a `traceparent` naming this
  span (the client's own is replaced), so vLLM started with `--otlp-traces-endpoint` puts
  its spans in the same trace. At the end the span gets the attributes below and its status
  (ERROR for a 5xx), and goes to a BatchSpanProcessor: export happens on the processor's
  own thread, in batches, with a bounded queue that drops spans when full, so an OTLP
  collector that is slow, down or unreachable never blocks or slows a request.

Attributes (`controlpanel.*` unless OpenTelemetry's conventions have a name):
`gen_ai.request.model` and `controlpanel.model` (the served model, an alias's target),
`controlpanel.alias`, `controlpanel.policy`, `controlpanel.decision` (the policy's kind of
decision: prefix, load, fallback, ...), `controlpanel.worker`, `controlpanel.retries`,
`controlpanel.ttfb_ms` (time to the first body byte), `http.response.status_code` (499:
the client left first) and `controlpanel.key_prefix` (the client key's public prefix).

The exporter is OTLP over HTTP/protobuf (opentelemetry-exporter-otlp-proto-http) and reads
the standard variables itself: OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/traces` is appended),
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TIMEOUT;
the SDK reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG) and
OTEL_BSP_* (queue size, batch size, delay). A bad endpoint or an unsupported protocol stops
the router at start with a message naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from routing.asgi_types import Scope

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Span, Tracer

    from routing.exchange import Exchange

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
SERVICE_NAME = "vllm-controlpanel-router"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
CLIENT_CLOSED = 499


class TracingConfigError(ValueError):
    """A tracing variable the router cannot use; the message names it."""


def tracing_wanted(env: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def tracer_from_env() -> RequestTracer | None:
    """The router's tracer when the environment asks for traces, else None (the default)."""
    if not tracing_wanted():
        return None
    _check_env()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return RequestTracer.with_processor(BatchSpanProcessor(OTLPSpanExporter()))


def _check_env() -> None:
    for name in ENDPOINT_VARIABLES:
        value = os.environ.get(name, "").strip()
        parts = urlsplit(value)
        if value and (parts.scheme not in ("http", "https") or not parts.hostname):
            raise TracingConfigError(f"{name}={value!r} is not an http(s)://host[:port] URL")
    for name in PROTOCOL_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value and value != "http/protobuf":
            raise TracingConfigError(
                f"{name}={value!r}: the router exports OTLP over http/protobuf only "
                "(point it at the collector's HTTP port, 4318)"
            )


class RequestTracer:
    """Starts and ends the span of one routed request; see the module docstring."""

    def __init__(self, tracer: Tracer, shutdown: Callable[[], None] = lambda: None) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.shutdown = shutdown
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER

    @classmethod
    def with_processor(cls, processor: SpanProcessor) -> RequestTracer:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES over this.
        provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("routing.proxy"), provider.shutdown)

    def start(self, scope: Scope) -> Span:
        """The request's span, child of the client's traceparent if any; the headers the
        worker will get carry this span's traceparent instead of the client's."""
        from opentelemetry.trace import set_span_in_context

        headers = scope["headers"]
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in headers
            if key in _TRACE_HEADERS
        }
        parent = self._propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            f"router {scope['path']}",
            context=parent,
            kind=self._server,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        )
        outgoing: dict[str, str] = {}
        self._propagator.inject(outgoing, context=set_span_in_context(span))
        kept = [(k, v) for k, v in headers if k not in _TRACE_HEADERS]
        scope["headers"] = kept + [(k.encode(), v.encode()) for k, v in outgoing.items()]
        return span

    def end(self, span: Span, ex: Exchange, worker_label: Callable[[int | None], str]) -> None:
        """Attributes from what the request did, then the end."""
        from opentelemetry.trace import Status, StatusCode

        trace = ex
        status = trace.status or CLIENT_CLOSED
        attributes: dict[str, Any] = {"http.response.status_code": status}
        if trace.model:
            attributes["gen_ai.request.model"] = attributes["controlpanel.model"] = trace.model
        if ex.rewriter is not None:
            attributes["controlpanel.alias"] = ex.rewriter.alias
        policy = getattr(ex, "policy", None)  # unset until the request reached a route
        if policy is not None:
            attributes["controlpanel.policy"] = policy.name
        if ex.decision:
            attributes["controlpanel.decision"] = ex.decision
        if trace.worker_id is not None:
            attributes["controlpanel.worker"] = worker_label(trace.worker_id)
        attributes["controlpanel.retries"] = max(0, ex.attempts - 1)
        if trace.first_byte is not None:
            attributes["controlpanel.ttfb_ms"] = round((trace.first_byte - trace.started) * 1e3, 3)
        key = ex.client
        if key is not None:
            attributes["controlpanel.key_prefix"] = key.prefix
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end()
