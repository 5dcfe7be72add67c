"""What one simulated run is given (`SimConfig`) and what it produces (`RunResult`).

`SimConfig`'s fields are documented in `polyserve.simulator.cluster` (the run itself);
`validate` names the field to fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from polyserve.core.queue_order import ORDER_KEYS
from polyserve.dispatcher import policy_aladdin as aladdin
from polyserve.dispatcher.policy import POLICIES
from polyserve.simulator import autoscale as auto
from polyserve.simulator import power as pw
from polyserve.simulator.engine import SimRequest, WorkerConfig

SIM_POLICIES = (*POLICIES, "aladdin_rebalance")
"""Placement names: every dispatcher policy, plus Aladdin with Alg. 2 re-balancing."""
NEEDS_REQUESTS = {"aladdin", "aladdin_rebalance", "caraserve"}
"""Policies whose worker views carry every request (the others see counts only)."""


@dataclass
class SimConfig:
    """One simulated run (the options are described in `polyserve.simulator.cluster`)."""

    policy: str = "least_outstanding"
    order: str = "fcfs"
    workers: int = 1
    autoscale: bool = False
    max_workers: int = 512
    idle_release_s: float = 30.0
    cold_start_s: float = 0.0
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    ttft_slo_ms: float = aladdin.TTFT_SLO_MS
    atgt_slo_ms: float = aladdin.ATGT_SLO_MS
    gamma: float = 0.5
    theta: float = 0.9
    slack: str = "banked"  # Aladdin constraint (d), see policy_aladdin.ongoing_slack_ms
    rebalance_s: float = 0.25  # not read: Alg. 2 re-balancing runs every tick_s (kept for results' configs)
    tick_s: float = 1.0
    max_input_len: int = 0  # 0 = no limit
    aging_s: float = 0.0  # ssjf_class aging period (s per length class); 0 = the worker's default
    # ssjf (size rank with a bounded overtake window, core.queue_order.SizeRule, one per worker);
    # 0 / < 0 = the worker's default
    ssjf_input_weight: float = -1.0
    ssjf_window_factor: float = 0.0
    ssjf_window_s: float = 0.0
    # the model's context window (tokens; 0 = none): a prompt at or over it is rejected
    # ("reject") or cut to fit ("truncate"); an output is capped at what the window leaves
    context_limit: int = 0
    over_context: str = "reject"
    profiled_prefill_tokens: int = 0  # the longest prompt the profile was measured on (0 = unknown)
    fit_online: bool = False  # policies see a PerfFitter's model, fed with the steps' timings
    abort_misses: int = 0  # stop once more requests than this missed an SLO (0 = never): for searches
    seed: int = 0
    # planner autoscalers (simulator.autoscale); "" = none
    autoscaler: str = ""
    initial_workers: int = 0  # workers at the start with an autoscaler (0 = `workers`, the minimum)
    planner_period_s: float = 15.0
    scaler_window_s: float = 30.0
    stabilization_s: float = 30.0
    threshold_factor: float = 0.6
    pertoken_threshold_ms: float = 0.0  # 0 = auto (simulator.autoscale.auto_thresholds)
    request_threshold_ms: float = 0.0
    tracking_slo_ms: float = 0.0
    tracking_metric: str = "pertoken"
    tracking_up_at: float = 0.95
    tracking_down_below: float = 0.50
    tracking_hold_s: float = 60.0
    muserve_idle_release_s: float = 60.0
    reset_window_on_scale: bool = True
    live_pertoken: bool = False  # per-token HPA also sees in-flight requests (simulator.autoscale docstring)
    scaler_max_step: int = 0  # HPA: most workers added/removed per decision (0 = no limit, the planner's default)
    rise_factor: float = 1.25  # "load rise": first planner period with rate >= this x the first minute's
    # clocks and power (simulator.power); clock "" = no clock control, energy at the maximum clock
    clock: str = ""
    gpu: str = "h100"
    clock_period_s: float = 0.5
    miad_step_mhz: int = 100
    miad_threshold: float = 0.05
    miad_window_s: float = 2.0
    miad_quantile: float = 99.0
    miad_min_mhz: int | str = 0  # 0 = the GPU's minimum; "auto" = power.auto_floor
    miad_floor_quantile: float = 99.9  # auto floor: percentile of the trace's prompt lengths
    scale_out_after: int = 4
    power_bin_s: float = 10.0

    def validate(self) -> None:
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; choose one of {', '.join(SIM_POLICIES)}")
        if self.order not in ORDER_KEYS:
            raise ValueError(f"order {self.order!r} is unknown; choose one of {', '.join(ORDER_KEYS)}")
        if self.workers < 1 or self.max_workers < self.workers:
            raise ValueError("need 1 <= workers <= max_workers")
        if self.over_context not in ("reject", "truncate"):
            raise ValueError("over_context must be 'reject' or 'truncate'")
        if self.context_limit < 0:
            raise ValueError("context_limit must be >= 0 (0 = no limit)")
        if self.worker.kv_mode not in ("grow", "reserve"):
            raise ValueError("kv_mode must be 'grow' or 'reserve'")
        if self.autoscaler:
            auto.canonical(self.autoscaler)
            if self.autoscale:
                raise ValueError("autoscale (Aladdin's signal) and autoscaler are exclusive; pick one")
            if self.initial_workers and not self.workers <= self.initial_workers <= self.max_workers:
                raise ValueError("need workers <= initial_workers <= max_workers")
            if self.planner_period_s <= 0 or self.scaler_window_s <= 0:
                raise ValueError("planner_period_s and scaler_window_s must be > 0")
        if self.clock and self.clock not in pw.CLOCK_MODES:
            raise ValueError(f"clock {self.clock!r} is unknown; choose one of {', '.join(pw.CLOCK_MODES)}")
        if self.clock_period_s <= 0 or self.power_bin_s <= 0:
            raise ValueError("clock_period_s and power_bin_s must be > 0")
        pw.gpu_spec(self.gpu)
        if isinstance(self.miad_min_mhz, str) and self.miad_min_mhz != "auto":
            raise ValueError(f"miad_min_mhz {self.miad_min_mhz!r}: give MHz (an integer) or 'auto'")
        if not 0 < self.miad_floor_quantile <= 100:
            raise ValueError("miad_floor_quantile must be in (0, 100]")


@dataclass
class RunResult:
    """What one run produced: every request (times in s) and the cluster's footprint."""

    config: dict
    requests: list[SimRequest]
    horizon_s: float
    gpu_seconds: float
    gpus_peak: int
    timeline: list[tuple[float, int]]  # (time, workers up)
    counters: dict
    wall_s: float
    fit_errors: dict | None = None
    extra: dict = field(default_factory=dict)  # energy, clocks, autoscaler record (accounting.Accounting)
