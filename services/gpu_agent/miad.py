"""µ-Serve's MIAD GPU frequency controller (§3.4, Alg. 3), as a pure step function.

Every `interval_s` (500 ms) the agent samples each hosted worker's latency against
its SLO target and calls `miad_step`:

* slack = (target − actual) / target for each worker with a latency sample;
* any worker with slack < threshold (0.05) → UP: the clock doubles, capped at MAX;
* otherwise a worker allows DOWN when the estimated degradation of one step down,
  weight · actual · STEP / freq (Alg. 3 lines 15–16), divided by its target, is
  below slack − threshold; the clock then drops by STEP, clamped at MIN;
* else SAME.

The weight is the worker's frequency sensitivity: the share of its latency that
scales with 1/f at the current clock (`gpu_model.WorkLatency.elasticity`), so an
insensitive (memory-bound) worker tolerates more down-scaling, as §3.4 says.

One reading choice: Alg. 3 as printed sets DOWN when *any* worker passes the test
(line 18, no break), yet the text says the most sensitive partition on a device
bounds its clock (§3.2). The default `down_requires_all=True` lowers the clock only
when every worker with a sample can afford it; `down_requires_all=False` is the
literal listing. Workers with no sample in the window do not vote.

Scale-out signal (§3.4, last paragraph): when the clock is already at MAX and UP is
asked again `scale_out_after` times in a row, the decision says `scale_out` and
names the workers missing their SLO; the planner's µ-Serve autoscaler acts on it.

The agent actuates a decision only with `allow_clock_control` (DESIGN.md, rules);
otherwise it publishes what it would set.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polyserve import proto as _proto

UP, DOWN, SAME = "up", "down", "same"


@dataclass(frozen=True)
class MiadConfig:
    min_mhz: int
    max_mhz: int
    step_mhz: int = 100
    threshold: float = 0.05
    default_mhz: int = 0  # 0 = max_mhz (Alg. 3 line 3: start from the default high clock)
    down_requires_all: bool = True
    scale_out_after: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.min_mhz <= self.max_mhz:
            raise ValueError(f"need 0 < min_mhz <= max_mhz, got {self.min_mhz}, {self.max_mhz}")
        if self.step_mhz <= 0 or not 0 <= self.threshold < 1:
            raise ValueError("step_mhz must be > 0 and threshold in [0, 1)")


@dataclass(frozen=True)
class PartitionObs:
    """One hosted worker (µ-Serve: a model partition) as the controller sees it."""

    name: str
    target_ms: float
    actual_ms: float | None  # None: no completed request in the window
    weight: float = 1.0


@dataclass(frozen=True)
class MiadState:
    freq_mhz: int
    up_at_max: int = 0  # consecutive UP requests while already at MAX


@dataclass(frozen=True)
class MiadDecision:
    freq_mhz: int
    previous_mhz: int
    action: str
    reason: str
    scale_out: bool = False
    missing: tuple[str, ...] = ()  # workers whose slack is below the threshold


def initial_state(cfg: MiadConfig) -> MiadState:
    return MiadState(freq_mhz=min(cfg.max_mhz, max(cfg.min_mhz, cfg.default_mhz or cfg.max_mhz)))


def slack(target_ms: float, actual_ms: float) -> float:
    return (target_ms - actual_ms) / target_ms


def miad_step(state: MiadState, partitions: Sequence[PartitionObs], cfg: MiadConfig) -> tuple[MiadState, MiadDecision]:
    """One iteration of Alg. 3 (module docstring)."""
    freq = state.freq_mhz
    sampled = [p for p in partitions if p.actual_ms is not None and p.target_ms > 0]
    missing = tuple(p.name for p in sampled if slack(p.target_ms, p.actual_ms) < cfg.threshold)
    votes = []
    for p in sampled:
        s = slack(p.target_ms, p.actual_ms)
        degradation = max(0.0, p.weight) * p.actual_ms * cfg.step_mhz / freq
        votes.append(degradation / p.target_ms < s - cfg.threshold)
    if missing:
        action = UP
        new = min(cfg.max_mhz, freq * 2)
        worst = min(sampled, key=lambda p: slack(p.target_ms, p.actual_ms))
        reason = (f"{len(missing)} worker(s) below slack {cfg.threshold:g} (worst {worst.name}: "
                  f"{worst.actual_ms:.1f} ms vs {worst.target_ms:.1f} ms target)")
    elif votes and (all(votes) if cfg.down_requires_all else any(votes)):
        action = DOWN
        new = max(cfg.min_mhz, freq - cfg.step_mhz)
        reason = f"{sum(votes)}/{len(votes)} worker(s) can absorb one {cfg.step_mhz} MHz step"
    else:
        action, new = SAME, freq
        reason = "no latency sample in the window" if not sampled else "slack too small to step down"
    up_at_max = state.up_at_max + 1 if action == UP and freq >= cfg.max_mhz else 0
    scale_out = up_at_max >= cfg.scale_out_after
    if scale_out:
        reason += f"; at max clock and still missing the SLO {up_at_max} times in a row: scale out"
    elif action == UP and freq >= cfg.max_mhz:
        reason += "; already at max clock"
    return MiadState(new, up_at_max), MiadDecision(new, freq, action, reason, scale_out, missing)


# The wire message lives in proto (tag "clock"); re-exported for callers of this module.
ClockDecision = _proto.ClockDecision
