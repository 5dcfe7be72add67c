"""Admission, one path for every endpoint that serves a model (completions, chat and
embeddings), after the endpoint validated its body:

1. `admit()`: refuse while draining (503) or over the in-flight limit (429, both with
   Retry-After), resolve the request's `model` to a deployment (and a LoRA adapter);
   404 when it names none, 503 when the cluster state cannot be read.
2. `Admission.begin()` / `end()`: the request's in-flight slot and its server span.
3. `predict()`: the predictor's output-length hint, clamped by the predictor to the
   request's max_tokens (completions; an embedding produces no tokens).
4. `place()`: the dispatcher's placement, with its `dispatched` event.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from polyserve.proto import (
    AdapterSpec,
    Deployment,
    Dispatched,
    DispatchRequest,
    Placement,
    Predicted,
    Prediction,
    PredictRequest,
)
from polyserve.shared.bus import BusError

from .context import GatewayState
from .errors import GatewayError, status_of
from .policy import InvalidRequest


@dataclass
class Admission:
    """An admitted request: its deployment, the adapter it names, and (between `begin`
    and `end`) its in-flight slot and server span."""

    gs: GatewayState
    deployment: Deployment
    adapter: AdapterSpec | None = None
    span: Span | None = None

    def begin(self, name: str, headers: Mapping[str, str]) -> Span:
        """Take the in-flight slot and start the server span (parent: the client's trace headers)."""
        self.span = self.gs.tracer.start_span(name, kind=SpanKind.SERVER, context=propagate.extract(dict(headers)))
        self.gs.inflight += 1
        self.gs.metrics.inflight.inc()
        return self.span

    def failed(self, exc: GatewayError) -> None:
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, exc.message))

    def end(self) -> None:
        """Give the slot back and end the span (once)."""
        if self.span is None:
            return
        self.gs.inflight -= 1
        self.gs.metrics.inflight.dec()
        self.span.end()
        self.span = None


async def admit(gs: GatewayState, model: str, adapter: str | None = None) -> Admission:
    """Admit a request for `model` (and the explicitly named LoRA `adapter`); raises
    GatewayError or InvalidRequest saying why not."""
    s = gs.settings
    if gs.draining:
        gs.metrics.rejected.labels("draining").inc()
        raise GatewayError(503, "the gateway is shutting down; retry on another instance", retry_after=1)
    if gs.inflight >= s.max_inflight:
        gs.metrics.rejected.labels("overload").inc()
        raise GatewayError(429, f"too many requests in flight ({s.max_inflight}); retry shortly", retry_after=1)
    try:
        deployment, spec = await gs.find_deployment(model)
    except Exception as exc:
        raise GatewayError(503, f"cluster state unavailable: {exc}", retry_after=1) from exc
    if deployment is None:
        raise InvalidRequest(f"The model '{model}' does not exist; GET /v1/models lists the served models",
                             "model", 404, "model_not_found")
    if adapter:
        spec = gs.adapters.get(adapter)
        if spec is None or spec.deployment != deployment.id:
            known = sorted(a.name for a in gs.adapters.values() if a.deployment == deployment.id)
            raise InvalidRequest(f"unknown adapter '{adapter}' for '{deployment.id}'; registered: "
                                 f"{known or 'none'} (POST /v1/adapters)", "adapter", 404, "adapter_not_found")
    return Admission(gs, deployment, spec)


async def predict(gs: GatewayState, req: PredictRequest, base: dict) -> Prediction:
    """The predictor's answer to `req` (never above `req.max_tokens` when that is set);
    publishes `predicted`. `base` holds the event's request_id, deployment and model."""
    t = time.monotonic()
    try:
        p = await gs.bus.request(gs.subjects.predict, req, Prediction, timeout=gs.settings.predict_timeout_s,
                                 span_name="predict")
    except BusError as exc:
        raise status_of(exc, "predictor") from exc
    await gs.event("predicted", Predicted(**base, length_class=p.length_class, tokens_estimate=p.tokens_estimate,
                                          source=p.source, latency_ms=(time.monotonic() - t) * 1e3))
    return p


async def place(gs: GatewayState, req: DispatchRequest, base: dict) -> Placement:
    """The dispatcher's placement of `req`; publishes `dispatched`."""
    t = time.monotonic()
    try:
        placement = await gs.bus.request(gs.subjects.dispatch, req, Placement,
                                         timeout=gs.settings.dispatch_timeout_s, span_name="dispatch")
    except BusError as exc:
        raise status_of(exc, "dispatcher") from exc
    await gs.event("dispatched", Dispatched(**base, worker_id=placement.worker_id, policy=placement.policy,
                                            latency_ms=(time.monotonic() - t) * 1e3))
    return placement
