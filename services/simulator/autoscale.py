"""The planner's autoscalers driving the simulated cluster (SIMULATED).

Every `period_s` (15 s) `PlannerLoop.observe` builds the planner's `Observation` from
the simulation — the requests completed in the last `window_s` (as
`planner.policy.Sample`: finish time, end-to-end latency, output tokens, TTFT), the
outstanding requests of each serving worker, the workers still cold-starting
(`pending`) and µ-Serve's clock signals — and calls the scaler's own pure `step`
(`planner.autoscalers`, imported, not copied: the live planner steps the same HPA and
target_tracking objects each poll; its µ-Serve grows on MIAD scale signals instead).
Scaler names are `polyserve.core.names`'s: ``pertoken``, ``request``,
``target_tracking``, ``muserve`` (aliases such as ``tracking`` accepted). The cluster
applies the outcome: new workers serve after the cold start, removed ones (the
scaler's choice, else the least busy, starting workers first) stop taking requests,
hand their queue back to the dispatcher and stop when their running requests end.

With `live_pertoken` the per-token HPA also sees the requests still decoding, each as
its per-token latency so far ((now − arrival) / tokens generated, those with at least
one token): the thesis's exporter reports per-token latency "whenever an output token
is created" (§5.2), while a request's latency exists only when it completes. Without
it both HPA metrics come from completed requests (the planner's `Sample`s).

As the planner does (`reset_window_on_scale`), samples from before a scaling action
are not shown to the scaler after it.

Thresholds (defaults, `auto_thresholds`): each scaler's SLO is the workload's SLO
expressed in that scaler's own metric — a request's latency budget is
TTFT_SLO + (out − 1)·ATGT_SLO, its per-token budget that ÷ out — averaged over the
trace's requests (its history). The HPA thresholds are `factor` (0.6) of that mean
budget, per-token or per-request: the HPA rule holds the metric *at* its threshold,
so the threshold sits below the SLO to leave room for the tail (on the conv trace
at 4 workers the mean per-token latency is 0.6 of the P98). Target tracking (Arlo)
acts on the P98 itself, so its SLO is the mean per-token budget (factor 1).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from polyserve.core.names import UnknownName, canonical_scaler
from polyserve.planner.autoscalers import (
    AUTOSCALERS,
    ClockSignal,
    HpaScaler,
    MuServeScaler,
    Observation,
    Outcome,
    TargetTracking,
    WorkerLoad,
)
from polyserve.planner.policy import Sample

SCALERS = AUTOSCALERS
"""The scalers the simulator runs: `polyserve.core.names`'s metric scalers and µ-Serve."""


def canonical(name: str) -> str:
    """The one spelling of a simulated scaler (`polyserve.core.names`; aliases accepted)."""
    try:
        n = canonical_scaler(name)
    except UnknownName:
        n = ""
    if n not in SCALERS:
        raise ValueError(f"autoscaler {name!r} is unknown; choose from {', '.join(SCALERS)}")
    return n


@dataclass(frozen=True)
class Thresholds:
    pertoken_ms: float
    request_ms: float
    tracking_slo_ms: float


def auto_thresholds(output_len: np.ndarray, ttft_slo_ms: float, atgt_slo_ms: float, factor: float = 0.6,
                    pertoken_ms: float = 0.0, request_ms: float = 0.0, tracking_slo_ms: float = 0.0) -> Thresholds:
    """The module docstring's defaults; a given (non-zero) value wins."""
    out = np.maximum(1, np.asarray(output_len, dtype=float))
    budget = ttft_slo_ms + (out - 1) * atgt_slo_ms
    per_tok = float(np.mean(budget / out)) if out.size else atgt_slo_ms
    per_req = float(np.mean(budget)) if out.size else ttft_slo_ms
    return Thresholds(pertoken_ms or factor * per_tok, request_ms or factor * per_req, tracking_slo_ms or per_tok)


def make_scaler(name: str, *, min_workers: int, max_workers: int, th: Thresholds, window_s: float = 30.0,
                stabilization_s: float = 30.0, max_step: int = 0, tracking_metric: str = "pertoken", up_at: float = 0.95,
                down_below: float = 0.5, hold_s: float = 60.0, muserve_idle_release_s: float = 60.0):
    """The planner's scaler object for `name` with the simulator's figures."""
    n = canonical(name)
    if n in ("pertoken", "request"):
        return HpaScaler(kind=n, threshold_ms=th.pertoken_ms if n == "pertoken" else th.request_ms,
                         min_replicas=min_workers, max_replicas=max_workers, window_s=window_s,
                         stabilization_s=stabilization_s, max_step=max_step)
    if n == "target_tracking":
        if tracking_metric not in ("pertoken", "request"):
            raise ValueError("target_tracking metric must be 'pertoken' or 'request'")
        return TargetTracking(slo_ms=th.tracking_slo_ms, min_replicas=min_workers, max_replicas=max_workers,
                              up_at=up_at, down_below=down_below, hold_s=hold_s, metric=tracking_metric)
    return MuServeScaler(min_replicas=min_workers, max_replicas=max_workers, idle_release_s=muserve_idle_release_s)


def scaler_threshold(scaler) -> dict:
    """The figures a scaler decides on, for the results."""
    if isinstance(scaler, HpaScaler):
        return {"threshold_ms": scaler.threshold_ms, "window_s": scaler.window_s,
                "stabilization_s": scaler.stabilization_s, "max_step": scaler.max_step}
    if isinstance(scaler, TargetTracking):
        return {"slo_ms": scaler.slo_ms, "metric": scaler.metric, "up_at": scaler.up_at,
                "down_below": scaler.down_below, "hold_s": scaler.hold_s}
    return {"idle_release_s": scaler.idle_release_s}


class PlannerLoop:
    """The scaler, its state, the sample window and the record of its decisions."""

    def __init__(self, scaler, window_s: float, reset_window_on_scale: bool = True):
        self.scaler = scaler
        self.state = scaler.initial()
        self.window_s = window_s
        self.reset = reset_window_on_scale
        self.samples: deque[Sample] = deque()
        self.since = float("-inf")
        self.decisions: list[tuple[float, int, int, str]] = []  # (t, current, desired, reason)
        self.first_scale_out: float | None = None
        self.scale_outs = 0
        self.scale_ins = 0

    def completed(self, finish: float, e2e_ms: float, output_tokens: int, ttft_ms: float) -> None:
        self.samples.append(Sample(ts=finish, e2e_ms=e2e_ms, output_tokens=output_tokens, ttft_ms=ttft_ms))

    def observe(self, now: float, workers: list[WorkerLoad], pending: int,
                clock_signals: list[ClockSignal], live: list[Sample] = ()) -> Outcome:
        """One decision. `live`: samples of requests still in flight, shown to the scaler
        this time only (the per-token metric streamed per token, `live_pertoken`)."""
        t0 = max(now - self.window_s, self.since)
        while self.samples and self.samples[0].ts < now - self.window_s:
            self.samples.popleft()
        window = [s for s in self.samples if s.ts >= t0] + list(live)
        obs = Observation(now=now, current=len(workers) + pending, samples=window, workers=workers,
                          pending=pending, clock_signals=clock_signals)
        self.state, out = self.scaler.step(self.state, obs)
        self.decisions.append((now, obs.current, out.desired, out.reason))
        if out.desired != obs.current:
            if out.desired > obs.current:
                self.scale_outs += 1
                if self.first_scale_out is None:
                    self.first_scale_out = now
            else:
                self.scale_ins += 1
            if self.reset:
                self.since = now
        return out

    def first_scale_out_since(self, t: float) -> float | None:
        """Time of the first scale-out decided at or after `t` (None: none)."""
        return next((now for now, cur, want, _ in self.decisions if now >= t and want > cur), None)


def load_rise(arrivals: np.ndarray, bin_s: float, factor: float, baseline_s: float = 60.0) -> float | None:
    """Start of the first `bin_s` bin after the first `baseline_s` whose arrival rate is
    >= `factor` × the rate of the first `baseline_s` (None: no such bin)."""
    a = np.asarray(arrivals, dtype=float)
    if a.size < 2 or a[-1] <= baseline_s:
        return None
    base = np.count_nonzero(a < baseline_s) / baseline_s
    edges = np.arange(baseline_s, a[-1] + bin_s, bin_s)
    counts = np.histogram(a, bins=edges)[0] / bin_s
    hit = np.nonzero(counts >= factor * max(base, 1e-9))[0]
    return float(edges[hit[0]]) if hit.size else None
