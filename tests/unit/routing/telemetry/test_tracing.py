"""OpenTelemetry traces (routing.telemetry.tracing) are off by default, and the standard
OTEL_* variables turn them on; a bad one says which."""

from __future__ import annotations

import pytest

from routing.router import RouterApp
from routing.telemetry.tracing import RequestTracer, TracingConfigError, tracer_from_env


def test_tracing_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracer_from_env() is None
    assert RouterApp().tracer is None


def test_the_standard_variables_turn_it_on_and_bad_ones_say_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    tracer = tracer_from_env()
    assert isinstance(tracer, RequestTracer)
    tracer.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracer_from_env() is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        tracer_from_env()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        tracer_from_env()
