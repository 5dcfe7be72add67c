"""Prometheus metrics of one gateway (its own registry, so tests can run several).

Request metrics count this gateway's own requests (sum them over gateways). The fleet
metrics (workers, LoRA tiers, GPUs, scale decisions) come from NATS events every gateway
hears alike (observe.py): take `max` over gateways, not `sum`. Labels stay bounded:
deployment, status, reason, source, direction, tier, gpu_id; never a request or worker id."""
from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from polyserve.proto import EnergyReport, GpuTelemetry, Heartbeat

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
GPU_STALE_S = 60.0  # a GPU not reported for this long leaves the gauges (its agent is gone)


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
        self.affinity = Counter("polyserve_affinity_placements_total", "Requests with a prompt_cache_key placed by "
                                "this gateway: on the key's own worker (home) or, that one being overloaded, on the "
                                "next in the key's order (spilled)", ["deployment", "outcome"], registry=self.registry)
        self.prefix = Counter("polyserve_prefix_placements_total", "Requests placed by this gateway with prefix-aware "
                              "placement: on the worker that had their prompt's longest start (hit), elsewhere as it "
                              "was overloaded (spilled), or by the policy as no worker had 256+ characters of it (miss)",
                              ["deployment", "outcome"], registry=self.registry)
        self.fallbacks = Counter("polyserve_gateway_fallbacks_total", "Predictions (predict) and placements "
                                 "(dispatch) the gateway made itself: the predictor or dispatcher did not answer",
                                 ["kind"], registry=self.registry)
        self.atgt_hist = Histogram("polyserve_atgt_seconds", "Average time between generated tokens (ATGT) of "
                                   "completed requests with more than one output token", ["deployment"],
                                   buckets=_BUCKETS, registry=self.registry)
        self.queue_hist = Histogram("polyserve_queue_seconds", "Time completed requests waited in a worker's "
                                    "queue before they started", ["deployment"], buckets=_BUCKETS,
                                    registry=self.registry)
        self.output_tokens = Counter("polyserve_output_tokens_total", "Output tokens of completed requests",
                                     ["deployment"], registry=self.registry)
        self.prompt_tokens = Counter("polyserve_prompt_tokens_total", "Prompt tokens of completed requests: those "
                                     "the engine took from its prefix cache (cached; vllm and openai-http engines "
                                     "report them) and the rest (computed)", ["deployment", "source"],
                                     registry=self.registry)
        self.predictions = Counter("polyserve_predictions_total", "Output-length predictions by source "
                                   "(the predictor's model or cache, or the gateway's local-* fallback)",
                                   ["deployment", "source"], registry=self.registry)
        self.prediction_error = Histogram("polyserve_prediction_error_ratio", "|predicted - actual| / actual "
                                          "output tokens of completed requests", ["deployment"],
                                          buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5), registry=self.registry)
        self.scale_decisions = Counter("polyserve_scale_decisions_total", "Planner scale decisions heard on "
                                       "NATS, by direction (up, down, hold)", ["deployment", "direction"],
                                       registry=self.registry)
        # Client keys (issue 14): tenants are made by the operator (POST /v1/keys), so the label stays bounded.
        self.tenant_tokens = Counter("polyserve_tenant_tokens_total", "Tokens used by requests with a client "
                                     "API key, by tenant and kind (prompt, completion)", ["tenant", "kind"],
                                     registry=self.registry)
        self.tenant_requests = Counter("polyserve_tenant_requests_total", "Completed requests with a client "
                                       "API key, by tenant", ["tenant"], registry=self.registry)
        self.fair_wait = Histogram("polyserve_fair_queue_seconds", "Time requests waited in the gateway's "
                                   "fair (VTC) queue before they started", ["deployment"], buckets=_BUCKETS,
                                   registry=self.registry)

    def tenant_used(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.tenant_requests.labels(tenant).inc()
        self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant, "completion").inc(completion_tokens)

    def finished(self, deployment: str, status: int, seconds: float | None = None) -> None:
        self.requests.labels(deployment, str(status)).inc()
        if seconds is not None:
            self.latency.labels(deployment).observe(seconds)

    def ttft(self, deployment: str, seconds: float) -> None:
        self.ttft_hist.labels(deployment).observe(seconds)

    def completed(self, deployment: str, output_tokens: int, atgt_ms: float, queue_ms: float,
                  predicted_tokens: int = 0, input_tokens: int = 0, cached_tokens: int = 0) -> None:
        """A completed generation (embeddings have no output tokens and are left out)."""
        if output_tokens <= 0:
            return
        self.output_tokens.labels(deployment).inc(output_tokens)
        cached = min(max(0, cached_tokens), max(0, input_tokens))
        self.prompt_tokens.labels(deployment, "cached").inc(cached)
        self.prompt_tokens.labels(deployment, "computed").inc(max(0, input_tokens) - cached)
        self.queue_hist.labels(deployment).observe(max(0.0, queue_ms) / 1e3)
        if output_tokens > 1 and atgt_ms > 0:
            self.atgt_hist.labels(deployment).observe(atgt_ms / 1e3)
        if predicted_tokens > 0:
            self.prediction_error.labels(deployment).observe(abs(predicted_tokens - output_tokens) / output_tokens)

    def scale(self, deployment: str, current: int, desired: int) -> None:
        direction = "up" if desired > current else "down" if desired < current else "hold"
        self.scale_decisions.labels(deployment, direction).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FleetCollector(Collector):
    """Gauges computed at scrape time: live workers (fresh heartbeats), their running and
    waiting requests and LoRA adapters by tier, per deployment; and per GPU its last
    telemetry (power, SM clock, energy counter) and energy per output token."""

    def __init__(self, heartbeats: Callable[[], Iterable[Heartbeat]],
                 gpus: dict[str, tuple[float, GpuTelemetry]], energy: dict[str, tuple[float, EnergyReport]]):
        self.heartbeats, self.gpus, self.energy = heartbeats, gpus, energy

    def collect(self):
        yield from self._workers()
        yield from self._gpus()

    def _workers(self):
        workers = GaugeMetricFamily("polyserve_workers", "Live workers (fresh heartbeats)", labels=["deployment"])
        running = GaugeMetricFamily("polyserve_worker_running", "Requests running on the live workers",
                                    labels=["deployment"])
        waiting = GaugeMetricFamily("polyserve_worker_waiting", "Requests queued on the live workers",
                                    labels=["deployment"])
        lora = GaugeMetricFamily("polyserve_lora_adapters", "LoRA adapters on the live workers, by tier "
                                 "(gpu, loading, host, disk)", labels=["deployment", "tier"])
        count, run, wait, tiers = Tally(), Tally(), Tally(), Tally()
        for hb in self.heartbeats():
            count[hb.deployment] += 1
            run[hb.deployment] += hb.running
            wait[hb.deployment] += hb.waiting
            for a in hb.adapters:
                tiers[(hb.deployment, a.tier)] += 1
        for dep, n in count.items():
            workers.add_metric([dep], n)
            running.add_metric([dep], run[dep])
            waiting.add_metric([dep], wait[dep])
        for (dep, tier), n in tiers.items():
            lora.add_metric([dep, tier], n)
        return workers, running, waiting, lora

    def _gpus(self):
        power = GaugeMetricFamily("polyserve_gpu_power_watts", "GPU power draw", labels=["gpu_id"])
        clock = GaugeMetricFamily("polyserve_gpu_sm_clock_mhz", "GPU SM clock", labels=["gpu_id"])
        joules = GaugeMetricFamily("polyserve_gpu_energy_joules", "GPU energy counter (since its agent "
                                   "started)", labels=["gpu_id"])
        per_token = GaugeMetricFamily("polyserve_gpu_energy_per_output_token_joules", "Energy per output "
                                      "token over the GPU's last energy window", labels=["gpu_id"])
        now = time.monotonic()
        for gpu_id, (seen, t) in list(self.gpus.items()):
            if now - seen > GPU_STALE_S:
                continue
            power.add_metric([gpu_id], t.power_w)
            clock.add_metric([gpu_id], t.sm_clock_mhz)
            joules.add_metric([gpu_id], t.energy_j)
        for gpu_id, (seen, r) in list(self.energy.items()):
            if now - seen <= GPU_STALE_S and r.j_per_token is not None:
                per_token.add_metric([gpu_id], r.j_per_token)
        return power, clock, joules, per_token
