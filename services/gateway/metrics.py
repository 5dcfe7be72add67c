"""Prometheus metrics of one gateway (its own registry, so tests can run several)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("polyserve_requests_total", "Finished requests by status",
                                ["deployment", "status"], registry=self.registry)
        self.latency = Histogram("polyserve_request_seconds", "End-to-end latency of successful requests",
                                 ["deployment"], buckets=_BUCKETS, registry=self.registry)
        self.ttft_hist = Histogram("polyserve_ttft_seconds", "Time to first token", ["deployment"],
                                   buckets=_BUCKETS, registry=self.registry)
        self.inflight = Gauge("polyserve_inflight_requests", "Requests in flight", registry=self.registry)
        self.rejected = Counter("polyserve_rejected_total", "Requests refused before admission",
                                ["reason"], registry=self.registry)
        self.fallbacks = Counter("polyserve_gateway_fallbacks_total", "Predictions (predict) and placements "
                                 "(dispatch) the gateway made itself: the predictor or dispatcher did not answer",
                                 ["kind"], registry=self.registry)

    def finished(self, deployment: str, status: int, seconds: float | None = None) -> None:
        self.requests.labels(deployment, str(status)).inc()
        if seconds is not None:
            self.latency.labels(deployment).observe(seconds)

    def ttft(self, deployment: str, seconds: float) -> None:
        self.ttft_hist.labels(deployment).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
