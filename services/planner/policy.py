"""The per-token-latency autoscaler of the thesis (§5), as pure functions.

Metric (thesis §1 and §4.1): the per-token latency of one request is its
request latency divided by the number of tokens it generated,
``e2e_ms / output_tokens`` ("input query latency / number of generated
tokens"). The `pertoken` scaler's metric is the arithmetic mean of that ratio
over the requests that completed in the deployment's window (requests that
generated no token carry no per-token latency and are left out). The
`request` scaler's metric is the mean request latency ``e2e_ms`` over the same
window (the thesis's baseline).

Decision (thesis Listing 5.1, the Kubernetes HPA rule):
``desired = ceil(current × metric / threshold)``, clamped to
[min_replicas, max_replicas]. With no sample in the window the planner holds
`current` (clamped); with `current == 0` there is nothing to measure and it
asks for `min_replicas`.

Around that rule, three guards keep it from oscillating (each can be turned off):

* scale-down stabilisation (as Kubernetes HPA's `stabilizationWindowSeconds`):
  a scale-down goes only as low as the highest recommendation of the last
  `stabilization_s` seconds;
* start gating: no further scale-up while workers started earlier have not
  sent their first heartbeat yet (their capacity is not in the metric);
* `max_step`: at most this many workers added or removed per decision.

Signal-driven scalers (`aladdin`, `caraserve`, `muserve`, `signal`; the names are
`polyserve.core.names`'s): the
deployment grows by ONE worker per accepted `ScaleSignal` (the dispatcher's
Aladdin/CaraServe policy found no feasible worker, or a gpu-agent's MIAD is at
its maximum clock and still misses the SLO), see `signal_decision`; between
signals the periodic reconcile only keeps the count within
[min_replicas, max_replicas] (`hold_decision`): these papers define no
latency-driven scale-in. Metric-driven deployments (`pertoken`, `request`,
`target_tracking`) ignore signals.

Nothing here does I/O: the service passes in what it observed.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from polyserve.core import names
from polyserve.proto import ScalerPolicy

HPA_METRICS = ("pertoken", "request")  # the HPA metrics (thesis §5)
# signal-driven scaler type (`polyserve.core.names.SIGNAL_SCALERS`) -> the ScaleSignal sources it honours
SIGNAL_SOURCES: dict[str, tuple[str, ...]] = {
    "aladdin": ("aladdin",),
    "caraserve": ("caraserve",),
    "muserve": ("miad",),
    "signal": ("aladdin", "caraserve", "miad"),
}
assert set(SIGNAL_SOURCES) == set(names.SIGNAL_SCALERS)


def signal_sources(scaler_type: str) -> tuple[str, ...]:
    """The ScaleSignal sources a scaler type honours (none for the metric-driven types;
    aliases of `polyserve.core.names` are folded, unknown names honour none)."""
    try:
        return SIGNAL_SOURCES.get(names.canonical_scaler(scaler_type), ())
    except names.UnknownName:
        return ()


@dataclass(frozen=True)
class Sample:
    """One completed request as the planner keeps it (ts in the planner's clock, seconds)."""

    ts: float
    e2e_ms: float
    output_tokens: int
    ttft_ms: float = 0.0


class Window:
    """A bounded, time-ordered window of samples of one deployment."""

    def __init__(self, max_samples: int = 10_000):
        self._samples: deque[Sample] = deque(maxlen=max_samples)

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)

    def prune(self, before: float) -> None:
        """Drop samples older than `before` (they can no longer be in any window)."""
        while self._samples and self._samples[0].ts < before:
            self._samples.popleft()

    def since(self, t0: float) -> list[Sample]:
        return [s for s in self._samples if s.ts >= t0]

    def __len__(self) -> int:
        return len(self._samples)


def window_metric(samples: Iterable[Sample], scaler_type: str) -> tuple[float | None, int]:
    """(metric in ms, number of samples it averages); (None, 0) with no usable sample."""
    if scaler_type == "pertoken":
        values = [s.e2e_ms / s.output_tokens for s in samples if s.output_tokens > 0 and s.e2e_ms >= 0]
    elif scaler_type == "request":
        values = [s.e2e_ms for s in samples if s.e2e_ms >= 0]
    else:
        raise ValueError(f"unknown scaler type {scaler_type!r}; expected one of {HPA_METRICS}")
    if not values:
        return None, 0
    return sum(values) / len(values), len(values)


def clamp(n: int, lo: int, hi: int) -> int:
    """`n` within [lo, hi]; a misconfigured hi < lo yields lo."""
    return max(lo, min(n, max(lo, hi)))


def hpa_desired(current: int, metric: float | None, threshold: float, min_replicas: int,
                max_replicas: int, tolerance: float = 0.0) -> int:
    """Thesis Listing 5.1: ceil(current × metric / threshold), clamped to [min, max].

    No metric -> current (clamped); current == 0 -> min_replicas. Within
    `tolerance` of the threshold (|ratio − 1| <= tolerance) current is kept,
    as Kubernetes HPA does with its 0.1 default; the thesis rule is tolerance 0.
    """
    if current <= 0:
        return clamp(0, min_replicas, max_replicas)
    if metric is None or threshold <= 0:
        return clamp(current, min_replicas, max_replicas)
    ratio = metric / threshold
    if abs(ratio - 1.0) <= tolerance:
        return clamp(current, min_replicas, max_replicas)
    # round away float noise so 3 × 0.2/0.2 stays 3, not ceil(3.0000000000000004) = 4
    return clamp(math.ceil(round(current * ratio, 9)), min_replicas, max_replicas)


def stabilize(raw: int, current: int, history: Sequence[tuple[float, int]], now: float,
              window_s: float) -> int:
    """Scale-down stabilisation: no lower than the highest recommendation in the last window_s."""
    if raw >= current or window_s <= 0:
        return raw
    recent = [d for ts, d in history if ts >= now - window_s]
    return min(current, max([raw, *recent]))


@dataclass(frozen=True)
class Decision:
    """What the planner decided for one deployment, and why."""

    desired: int
    metric_ms: float | None
    samples: int
    reason: str
    recommended: int = 0  # the clamped HPA figure before the guards (kept for stabilisation)


def decide(current: int, samples: Iterable[Sample], scaler: ScalerPolicy, *, now: float,
           history: Sequence[tuple[float, int]] = (), stabilization_s: float = 0.0,
           pending: int = 0, max_step: int = 0, tolerance: float = 0.0) -> Decision:
    """One poll's decision for one deployment (see the module docstring).

    `history` holds this deployment's earlier (ts, recommendation) pairs;
    `pending` the workers started but not yet heartbeating.
    """
    metric, n = window_metric(samples, scaler.type)
    lo, hi = scaler.min_replicas, scaler.max_replicas
    raw = hpa_desired(current, metric, scaler.threshold_ms, lo, hi, tolerance)
    if current <= 0:
        reason = f"no running worker; starting min_replicas={lo}" if raw > 0 else "no worker wanted"
    elif metric is None:
        reason = f"no samples in the last {scaler.window_s:g}s; holding {current}"
        if raw != current:
            reason += f" clamped to [{lo}, {hi}]"
    elif scaler.threshold_ms <= 0:
        reason = f"threshold_ms {scaler.threshold_ms:g} is not positive; holding {current}"
    else:
        reason = (f"{scaler.type} latency {metric:.2f} ms vs threshold {scaler.threshold_ms:g} ms "
                  f"over {n} requests: ceil({current} x {metric / scaler.threshold_ms:.3f}) -> {raw}")
    desired = stabilize(raw, current, history, now, stabilization_s)
    if desired != raw:
        reason += f"; scale-down held at {desired} by the {stabilization_s:g}s stabilization window"
    if desired > current > 0 and pending > 0:
        desired = current
        reason += f"; waiting for {pending} starting worker(s) before scaling up"
    if max_step > 0 and abs(desired - current) > max_step and current > 0:
        desired = current + max_step if desired > current else current - max_step
        reason += f"; step limited to {max_step}"
    return Decision(desired=desired, metric_ms=metric, samples=n, reason=reason, recommended=raw)


def hold_decision(current: int, scaler: ScalerPolicy) -> Decision:
    """The periodic decision of a signal-driven scaler: `current` within [min, max]
    (min_replicas when nothing runs); growth comes from `signal_decision` only."""
    lo, hi = scaler.min_replicas, scaler.max_replicas
    desired = hpa_desired(current, None, scaler.threshold_ms, lo, hi)
    sources = ", ".join(signal_sources(scaler.type)) or "none"
    if current <= 0:
        reason = f"no running worker; starting min_replicas={lo}" if desired > 0 else "no worker wanted"
    elif desired != current:
        reason = f"{current} worker(s) outside [{lo}, {hi}]: -> {desired}"
    else:
        reason = f"{scaler.type} scaler: holding {current}; grows on scale signals from {sources}"
    return Decision(desired=desired, metric_ms=None, samples=0, reason=reason, recommended=desired)


def signal_decision(current: int, scaler: ScalerPolicy, source: str, *, now: float, last_signal: float | None,
                    cooldown_s: float, pending: int = 0, reason: str = "") -> Decision | None:
    """One ScaleSignal of a signal-driven deployment: one more worker, or None when the
    signal is dropped without a decision (not honoured by this scaler type, within
    `cooldown_s` of the last signal acted on, or workers still starting). A signal at
    max_replicas gives a decision that holds (so it is visible) and starts the cooldown."""
    if source not in signal_sources(scaler.type):
        return None
    if last_signal is not None and now - last_signal < cooldown_s:
        return None
    if pending > 0:
        return None
    why = f"scale signal from {source}" + (f" ({reason})" if reason else "")
    hi = max(scaler.min_replicas, scaler.max_replicas)
    if current >= hi:
        return Decision(desired=current, metric_ms=None, samples=0, reason=f"{why}; at max_replicas={hi}",
                        recommended=current)
    return Decision(desired=current + 1, metric_ms=None, samples=0, reason=f"{why}: add one worker",
                    recommended=current + 1)


# --------------------------------------------------------------------------- actuation
def plan_starts(agent_workers: Mapping[str, int], count: int) -> dict[str, int]:
    """Spread `count` new workers: each to the agent with the fewest workers (ties by id)."""
    load = dict(agent_workers)
    out: dict[str, int] = {}
    for _ in range(max(0, count)):
        if not load:
            break
        gpu = min(sorted(load), key=lambda g: load[g])
        load[gpu] += 1
        out[gpu] = out.get(gpu, 0) + 1
    return out


def plan_stops(agent_dep_workers: Mapping[str, int], count: int) -> dict[str, int]:
    """Remove `count` workers of a deployment: each from the agent hosting the most of them."""
    left = {g: n for g, n in agent_dep_workers.items() if n > 0}
    out: dict[str, int] = {}
    for _ in range(max(0, count)):
        if not left:
            break
        gpu = max(sorted(left), key=lambda g: left[g])
        left[gpu] -= 1
        out[gpu] = out.get(gpu, 0) + 1
        if left[gpu] == 0:
            del left[gpu]
    return out
