"""Tracing costs nothing when nothing exports: spans are sampled off but still carry trace ids."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from polyserve.shared.telemetry import make_tracer

pytestmark = pytest.mark.unit


def test_no_exporter_means_non_recording_spans_with_trace_ids(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    tracer, provider = make_tracer("t")
    with tracer.start_as_current_span("x") as span:
        assert not span.is_recording()
        assert span.get_span_context().trace_id != 0  # traceparent still propagates
    provider.shutdown()


def test_an_exporter_records_every_span(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    exp = InMemorySpanExporter()
    tracer, provider = make_tracer("t", exporter=exp)
    with tracer.start_as_current_span("x") as span:
        assert span.is_recording()
    assert [s.name for s in exp.get_finished_spans()] == ["x"]
    provider.shutdown()


def test_the_standard_sampler_variable_decides_when_set(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    tracer, provider = make_tracer("t")
    with tracer.start_as_current_span("x") as span:
        assert span.is_recording()
    provider.shutdown()


def test_an_exporting_service_records_under_a_caller_that_does_not(monkeypatch):
    """A gateway without export sends an unsampled traceparent; a worker that exports still
    records its spans, children of the caller's span."""
    from opentelemetry import trace

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    quiet, p1 = make_tracer("caller")
    exp = InMemorySpanExporter()
    loud, p2 = make_tracer("callee", exporter=exp)
    with quiet.start_as_current_span("client") as parent:
        ctx = trace.set_span_in_context(parent)
        with loud.start_as_current_span("server", context=ctx):
            pass
    [server] = exp.get_finished_spans()
    assert server.parent.span_id == parent.get_span_context().span_id
    p1.shutdown()
    p2.shutdown()
