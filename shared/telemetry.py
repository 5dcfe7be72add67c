"""OpenTelemetry set-up: one TracerProvider per service process.

Export goes to an OTLP/HTTP endpoint when one is configured (settings
`otlp_endpoint` or the standard OTEL_EXPORTER_OTLP_ENDPOINT); none by default.
Tests pass their own SpanExporter (the SDK's InMemorySpanExporter).

When nothing exports, spans are sampled off (`ALWAYS_OFF`): they carry trace ids but record
nothing, and the bus sends no `traceparent` for them (`bus.unsampled`); a service that
exports records all its spans (`ALWAYS_ON`), whatever the caller's sampled flag, so give every
service the same export setting (behind one that does not export, it starts its own traces). A recording span
with no exporter cost about 240 µs per NATS hop (docs/benchmarks/overhead.md). The
standard OTEL_TRACES_SAMPLER variable, when set, decides instead.
"""
from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

logger = logging.getLogger(__name__)


def make_tracer(service: str, otlp_endpoint: str = "",
                exporter: SpanExporter | None = None) -> tuple[trace.Tracer, TracerProvider]:
    """A tracer for `service`, not installed globally (several services may share a process in tests)."""
    endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    provider = TracerProvider(resource=Resource.create({"service.name": f"polyserve-{service}"}),
                              sampler=_sampler(exporter is not None or bool(endpoint)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        logger.info("exporting traces to %s", url)
    return provider.get_tracer(f"polyserve.{service}"), provider


def _sampler(exporting: bool):
    """ALWAYS_ON when this service exports: its spans are recorded even under a caller that
    does not export (and so sent `traceparent` unsampled); ALWAYS_OFF when it does not. The
    standard OTEL_TRACES_SAMPLER variable, when set, decides instead (None: the SDK reads it)."""
    if os.environ.get("OTEL_TRACES_SAMPLER"):
        return None
    return ALWAYS_ON if exporting else ALWAYS_OFF


def shutdown_tracer(provider: TracerProvider) -> None:
    """Flush and stop span export."""
    try:
        provider.force_flush(timeout_millis=2000)
        provider.shutdown()
    except Exception:
        logger.exception("trace flush failed")


def setup_logging(level: str = "INFO") -> None:
    """Process-wide logging format for service entry points (not at import)."""
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
