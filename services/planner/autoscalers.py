"""Autoscaling policies behind one interface, pure: `step(state, observation) -> (state, outcome)`.

Time is passed in (`Observation.now`), state is returned, nothing does I/O, so the
live planner (`planner.service`, one step per deployment per poll, state kept in
`planner.state.PlannerState`) and the trace-driven simulator (`simulator.autoscale`)
run the very same code. `from_policy` builds the scaler a deployment's
`ScalerPolicy` names; `make_autoscaler` builds one by name with explicit settings.
Names are `polyserve.core.names`'s (aliases accepted on input, never written).

* `HpaScaler("pertoken" | "request")`: the thesis's HPA rule
  `ceil(current × metric / threshold)` on mean per-token latency or mean request
  latency, with the planner's stabilisation, start gating and step limit — it calls
  `planner.policy.decide`, it does not re-implement it.
* `TargetTracking` (Arlo §4, after AWS target tracking): add one worker when the P98
  latency of recently completed requests reaches `up_at` (95%) of the SLO; remove the
  least busy worker when P98 stays below `down_below` (50%) of the SLO for `hold_s`
  (60 s), then the 60 s start again. A window with no completed request counts as
  "below" only when serving workers are known and none has outstanding work (an idle
  deployment), otherwise it holds. Scale-out waits for workers still starting (`pending`), like the HPA.
  Live, a `target_tracking` deployment's `threshold_ms` is the SLO of its P98
  request latency.
* `MuServeScaler` (µ-Serve §3.4): one more worker when a GPU hosting this
  deployment is already at its maximum clock and its MIAD controller still asks to go
  up (`ClockSignal.scale_out`, from `gpu_agent.miad`) for a worker of this deployment.
  µ-Serve defines no scale-in; `idle_release_s` (default off) removes the least
  busy worker after that long with every worker idle. (The live planner's µ-Serve
  grows on MIAD `ScaleSignal`s as they arrive, see `SignalHold`.)
* `SignalHold` (the live signal-driven scalers `aladdin`, `caraserve`, `muserve`,
  `signal`): their growth comes from `ScaleSignal`s between polls
  (`policy.signal_decision`); their periodic step only keeps the count within
  [min_replicas, max_replicas] (`policy.hold_decision`).

Percentiles are nearest-rank: P98 of n samples is the ⌈0.98·n⌉-th smallest.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from polyserve.core.names import SIGNAL_SCALERS, canonical_scaler
from polyserve.planner import policy
from polyserve.planner.policy import Sample
from polyserve.proto import ScalerPolicy


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    load: float  # outstanding requests (running + waiting)


@dataclass(frozen=True)
class ClockSignal:
    """One GPU's MIAD state as a scaler needs it."""

    gpu_id: str
    scale_out: bool
    missing: tuple[str, ...] = ()  # workers below their SLO slack
    at_max: bool = False


@dataclass(frozen=True)
class Observation:
    """What the caller saw of one deployment at `now` (seconds, any monotone clock)."""

    now: float
    current: int
    samples: Sequence[Sample] = ()  # completed requests in the scaler's window
    workers: Sequence[WorkerLoad] = ()
    pending: int = 0  # workers started but not serving yet
    clock_signals: Sequence[ClockSignal] = ()


@dataclass(frozen=True)
class Outcome:
    desired: int
    reason: str
    metric_ms: float | None = None
    samples: int = 0
    remove: tuple[str, ...] = ()  # workers to stop, when the policy names them


class Autoscaler(Protocol):
    name: str

    def initial(self) -> Any: ...

    def step(self, state: Any, obs: Observation) -> tuple[Any, Outcome]: ...


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def least_busy(workers: Sequence[WorkerLoad], count: int = 1) -> tuple[str, ...]:
    return tuple(w.worker_id for w in sorted(workers, key=lambda w: (w.load, w.worker_id))[:count])


def _latencies(samples: Sequence[Sample], metric: str) -> list[float]:
    if metric == "pertoken":
        return [s.e2e_ms / s.output_tokens for s in samples if s.output_tokens > 0]
    return [s.e2e_ms for s in samples if s.e2e_ms >= 0]


# --------------------------------------------------------------------------- HPA (thesis)
@dataclass(frozen=True)
class HpaScaler:
    kind: str = "pertoken"  # "pertoken" | "request"
    threshold_ms: float = 50.0
    min_replicas: int = 1
    max_replicas: int = 4
    window_s: float = 30.0
    stabilization_s: float = 30.0
    tolerance: float = 0.0
    max_step: int = 0

    @property
    def name(self) -> str:
        return f"hpa-{self.kind}"

    def initial(self) -> tuple[tuple[float, int], ...]:
        return ()

    def step(self, state: tuple[tuple[float, int], ...], obs: Observation) -> tuple[tuple, Outcome]:
        scaler = ScalerPolicy(type=self.kind, min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                              window_s=self.window_s, threshold_ms=self.threshold_ms)
        history = [h for h in state if h[0] >= obs.now - self.stabilization_s]
        d = policy.decide(obs.current, [s for s in obs.samples if s.ts >= obs.now - self.window_s], scaler,
                          now=obs.now, history=history, stabilization_s=self.stabilization_s,
                          pending=obs.pending, max_step=self.max_step, tolerance=self.tolerance)
        removed = obs.current - d.desired
        remove = least_busy(obs.workers, removed) if removed > 0 and len(obs.workers) >= removed else ()
        return (*history, (obs.now, d.recommended)), Outcome(d.desired, d.reason, d.metric_ms, d.samples, remove)


# --------------------------------------------------------------------------- Arlo §4
@dataclass(frozen=True)
class TrackingState:
    below_since: float | None = None


@dataclass(frozen=True)
class TargetTracking:
    slo_ms: float
    min_replicas: int = 1
    max_replicas: int = 64
    up_at: float = 0.95
    down_below: float = 0.50
    hold_s: float = 60.0
    q: float = 98.0
    metric: str = "request"  # "request" (Arlo: request latency) | "pertoken"
    name: str = "target_tracking"

    def initial(self) -> TrackingState:
        return TrackingState()

    def step(self, state: TrackingState, obs: Observation) -> tuple[TrackingState, Outcome]:
        lat = _latencies(obs.samples, self.metric)
        p = percentile(lat, self.q)
        cur, lo, hi = obs.current, self.min_replicas, self.max_replicas
        if cur < lo:
            return TrackingState(), Outcome(lo, f"below min_replicas={lo}", p, len(lat))
        if p is not None and p >= self.up_at * self.slo_ms:
            why = f"P{self.q:g} {p:.1f} ms >= {self.up_at:g} x SLO {self.slo_ms:g} ms"
            if obs.pending > 0:
                return TrackingState(), Outcome(cur, f"{why}; waiting for {obs.pending} starting worker(s)", p, len(lat))
            if cur >= hi:
                return TrackingState(), Outcome(cur, f"{why}; at max_replicas={hi}", p, len(lat))
            return TrackingState(), Outcome(cur + 1, f"{why}: add one worker", p, len(lat))
        idle = p is None and bool(obs.workers) and all(w.load <= 0 for w in obs.workers)
        low = (p is not None and p < self.down_below * self.slo_ms) or idle
        if not low:
            why = "no completed request, work outstanding" if p is None else (
                f"P{self.q:g} {p:.1f} ms between {self.down_below:g} and {self.up_at:g} x SLO")
            return TrackingState(), Outcome(cur, f"{why}; holding {cur}", p, len(lat))
        since = state.below_since if state.below_since is not None else obs.now
        what = "idle" if p is None else f"P{self.q:g} {p:.1f} ms < {self.down_below:g} x SLO {self.slo_ms:g} ms"
        if obs.now - since < self.hold_s or cur <= lo:
            note = f"at min_replicas={lo}" if cur <= lo else f"for {obs.now - since:.0f}/{self.hold_s:g} s"
            return TrackingState(since), Outcome(cur, f"{what} {note}; holding {cur}", p, len(lat))
        remove = least_busy(obs.workers, 1)
        return TrackingState(obs.now), Outcome(cur - 1, f"{what} for {self.hold_s:g} s: remove the least busy "
                                                        f"worker {remove[0] if remove else ''}".rstrip(), p, len(lat),
                                               remove)


# --------------------------------------------------------------------------- µ-Serve §3.4
@dataclass(frozen=True)
class MuServeState:
    idle_since: float | None = None


@dataclass(frozen=True)
class MuServeScaler:
    min_replicas: int = 1
    max_replicas: int = 64
    idle_release_s: float = 0.0  # 0 = never scale in (µ-Serve defines no scale-in)
    name: str = "muserve"

    def initial(self) -> MuServeState:
        return MuServeState()

    def step(self, state: MuServeState, obs: Observation) -> tuple[MuServeState, Outcome]:
        cur, lo, hi = obs.current, self.min_replicas, self.max_replicas
        if cur < lo:
            return MuServeState(), Outcome(lo, f"below min_replicas={lo}")
        mine = {w.worker_id for w in obs.workers}
        hot = [s for s in obs.clock_signals if s.scale_out and (not mine or mine & set(s.missing))]
        if hot:
            why = f"GPU(s) {', '.join(sorted(s.gpu_id for s in hot))} at max clock still miss the SLO"
            if obs.pending > 0:
                return MuServeState(), Outcome(cur, f"{why}; waiting for {obs.pending} starting worker(s)")
            if cur >= hi:
                return MuServeState(), Outcome(cur, f"{why}; at max_replicas={hi}")
            return MuServeState(), Outcome(cur + 1, f"{why}: add one worker")
        if self.idle_release_s > 0 and obs.workers and all(w.load <= 0 for w in obs.workers) and cur > lo:
            since = state.idle_since if state.idle_since is not None else obs.now
            if obs.now - since >= self.idle_release_s:
                remove = least_busy(obs.workers, 1)
                return MuServeState(obs.now), Outcome(cur - 1, f"idle for {self.idle_release_s:g} s: release one",
                                                      remove=remove)
            return MuServeState(since), Outcome(cur, "idle; holding")
        return MuServeState(), Outcome(cur, "no GPU at max clock missing its SLO; holding")


# --------------------------------------------------------------------------- signal-driven (live)
@dataclass(frozen=True)
class SignalHold:
    """The periodic step of a signal-driven scaler: `current` within [min, max]."""

    kind: str = "signal"  # "aladdin" | "caraserve" | "muserve" | "signal"
    min_replicas: int = 1
    max_replicas: int = 4
    threshold_ms: float = 0.0

    @property
    def name(self) -> str:
        return self.kind

    def initial(self) -> None:
        return None

    def step(self, state: None, obs: Observation) -> tuple[None, Outcome]:
        scaler = ScalerPolicy(type=self.kind, min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                              threshold_ms=self.threshold_ms)
        d = policy.hold_decision(obs.current, scaler)
        return None, Outcome(d.desired, d.reason)


def make_autoscaler(kind: str, **kw: Any) -> Autoscaler:
    """"pertoken" | "request" -> HpaScaler; "target_tracking" -> TargetTracking; "muserve" ->
    MuServeScaler (the simulator's, on clock signals); "aladdin" | "caraserve" | "signal" ->
    SignalHold. Aliases of `polyserve.core.names` are accepted; UnknownName (a ValueError)
    otherwise."""
    kind = canonical_scaler(kind)
    if kind in ("pertoken", "request"):
        return HpaScaler(kind=kind, **kw)
    if kind == "target_tracking":
        return TargetTracking(**kw)
    if kind == "muserve":
        return MuServeScaler(**kw)
    return SignalHold(kind=kind, **kw)


def from_policy(sp: ScalerPolicy, *, stabilization_s: float = 0.0, tolerance: float = 0.0, max_step: int = 0,
                hold_s: float = 60.0) -> Autoscaler:
    """The scaler the live planner steps for a deployment's `ScalerPolicy` (the guards from
    the planner's settings): HpaScaler, TargetTracking (P98 request latency against
    `threshold_ms`, Arlo §4) or, for the signal-driven types, SignalHold."""
    kind = canonical_scaler(sp.type)
    lo, hi = sp.min_replicas, sp.max_replicas
    if kind in ("pertoken", "request"):
        return HpaScaler(kind=kind, threshold_ms=sp.threshold_ms, min_replicas=lo, max_replicas=hi,
                         window_s=sp.window_s, stabilization_s=stabilization_s, tolerance=tolerance,
                         max_step=max_step)
    if kind == "target_tracking":
        return TargetTracking(slo_ms=sp.threshold_ms, min_replicas=lo, max_replicas=hi, hold_s=hold_s,
                              metric="request")
    assert kind in SIGNAL_SCALERS
    return SignalHold(kind=kind, min_replicas=lo, max_replicas=hi, threshold_ms=sp.threshold_ms)


AUTOSCALERS = ("pertoken", "request", "target_tracking", "muserve")
"""The scalers the simulator steps on its own observations (`simulator.autoscale`)."""
__all__ = ["AUTOSCALERS", "Autoscaler", "ClockSignal", "HpaScaler", "MuServeScaler", "Observation", "Outcome",
           "Sample", "SignalHold", "TargetTracking", "WorkerLoad", "from_policy", "make_autoscaler", "percentile"]
