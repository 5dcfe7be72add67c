"""Clocks and energy of simulated GPUs. Every figure here is SIMULATED (modelled).

* Clock: each worker runs at a clock f (MHz). Its step times follow
  `gpu_agent.gpu_model`'s latency curve (prefill compute bound, ∝ 1/f; decode memory
  bound, flat down to the knee): `engine.SimWorker.clock_x` = f / f_max.
* Power: `gpu_model.power_w(spec, u, f)` per GPU, u = the share of time the worker is
  busy (a step running). The model is linear in u at a fixed clock, so the energy of
  an interval is exact without sampling:
      E = tp · [ P(0) · up-time + Σ_steps (P(1, f_step) − P(0)) · duration_step ]
  (P(0) does not depend on the clock). A worker draws idle power from the moment it
  is started (cold start included) until it is stopped.
* Clock control (`mode`): ``max`` keeps every GPU at f_max; ``miad`` runs µ-Serve's
  MIAD (`gpu_agent.miad.miad_step`, Alg. 3) per worker every `period_s` (500 ms).
  One worker is one clock domain (its tp GPUs move together). In ``max`` mode MIAD
  still runs with the clock pinned (min = max), so µ-Serve's scale-out signal (at max
  clock and still missing the SLO) exists for the µ-Serve autoscaler.

Automatic floor (`auto_floor`, ``--miad-min-mhz auto``): Alg. 3 reacts to slack every
500 ms, but a prefill already running at a low clock is not sped up in the model (a
step's duration is fixed when it starts), so the floor decides alone whether a long
prompt that arrives at the lowest clock meets the TTFT SLO. The auto floor is the
lowest clock at which the prefill of the `quantile` (P99.9) prompt length of the
trace (its history, as the predictor's) takes at most (1 − threshold)·TTFT_SLO — the
slack below which Alg. 3 (line 11) scales up, so that at the floor such a prompt
does not by itself put MIAD into an UP state. The P99.9 (not the P99) leaves most of a
99% attainment target to what the rule ignores: queueing behind another prefill,
batched prompts, and ATGT stalls of decoding requests during long prefills.

Defaults beyond Alg. 3: `window_s` = 2 s (four MIAD periods: the controller sees the
effect of its last step soon; with 5 s the conv trace at 0.5x load on 4 workers
attained 0.93 instead of 0.955, simulated) and `min_mhz` = the GPU's minimum; a
higher floor (`--miad-min-mhz`) trades power for attainment, since a long prompt
prefilled at a very low clock misses the TTFT SLO before MIAD can react.

What MIAD sees per worker (two partitions in Alg. 3's sense, both must afford a step
down): TTFT — the `quantile` (nearest rank) of the TTFTs of requests whose first token
came in the last `window_s`, together with the requests still without one — the one
being prefilled counts with its known first-token time, each queued one with its age
plus its prefill at the current clock (a lower bound), so a queue building up at a low
clock is seen before its requests miss — against the TTFT SLO; ATGT — the mean duration of the
worker's decode steps in the window (what a request decoding through the window
gets per token), against the ATGT SLO. Their weight (Alg. 3's frequency
sensitivity) is `gpu_model.llm_request(prefill, decode).elasticity(x)` of the
worker's work in the window.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from polyserve.gpu_agent import gpu_model
from polyserve.gpu_agent.miad import MiadConfig, MiadState, PartitionObs, initial_state, miad_step
from polyserve.planner.autoscalers import ClockSignal, percentile

GPUS = {"h100": gpu_model.H100_80GB, "a100": gpu_model.A100_80GB, "v100": gpu_model.V100_16GB}
CLOCK_MODES = ("max", "miad")


def gpu_spec(name: str) -> gpu_model.GpuClockSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"gpu {name!r} is unknown; choose one of {', '.join(GPUS)}") from None


def gpu_from_profile(raw: dict) -> str:
    """The `GPUS` key for a profile's "hardware" field (h100 when it names none we know)."""
    hw = str(raw.get("hardware", "")).lower()
    return next((k for k in GPUS if k in hw), "h100")


class PowerMeter:
    """Energy of the cluster (J, simulated): the step part as steps start, the idle
    part from the workers' up-times at the end; a per-bin series for plots."""

    def __init__(self, spec: gpu_model.GpuClockSpec, tp: int, bin_s: float = 10.0):
        self.spec, self.tp, self.bin_s = spec, tp, bin_s
        self.p_idle = gpu_model.power_w(spec, 0.0, spec.max_mhz)  # W per GPU, any clock
        self._busy_w: dict[int, float] = {}
        self.busy_j = 0.0
        self.busy_s = 0.0
        self.bins: dict[int, float] = {}

    def busy_power_w(self, mhz: int) -> float:
        """Extra power of one GPU while busy at `mhz` (W)."""
        w = self._busy_w.get(mhz)
        if w is None:
            w = self._busy_w[mhz] = gpu_model.power_w(self.spec, 1.0, mhz) - self.p_idle
        return w

    def step(self, t0: float, duration_s: float, mhz: int) -> None:
        e = self.tp * self.busy_power_w(mhz) * duration_s
        self.busy_j += e
        self.busy_s += duration_s
        k = int(t0 // self.bin_s)
        self.bins[k] = self.bins.get(k, 0.0) + e

    def finish(self, up_intervals: list[tuple[float, float]], horizon: float) -> dict:
        """Totals and the power series, given each worker's (started, stopped)."""
        idle_j = sum(self.tp * self.p_idle * max(0.0, b - a) for a, b in up_intervals)
        n = max(1, int(np.ceil(horizon / self.bin_s)))
        edges = np.arange(n + 1) * self.bin_s
        series = np.zeros(n)
        for k, e in self.bins.items():
            series[min(k, n - 1)] += e
        for a, b in up_intervals:  # idle energy per bin: overlap of [a, b) with each bin
            ov = np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0.0, None)
            series += self.tp * self.p_idle * ov
        width = np.diff(np.minimum(edges, max(horizon, 1e-9)))
        width[width <= 0] = self.bin_s
        gpu_s = sum(self.tp * max(0.0, b - a) for a, b in up_intervals)
        total = idle_j + self.busy_j
        return {"energy_j": total, "idle_j": idle_j, "busy_j": self.busy_j, "gpu_busy_s": self.tp * self.busy_s,
                "avg_power_w": total / horizon if horizon > 0 else 0.0,
                "power_per_gpu_w": total / gpu_s if gpu_s > 0 else 0.0,
                "util": self.tp * self.busy_s / gpu_s if gpu_s > 0 else 0.0,
                "power_t": edges[:-1].tolist(), "power_w": (series / width).tolist()}


def auto_floor(spec: gpu_model.GpuClockSpec, perf, input_len, ttft_slo_ms: float, threshold: float = 0.05,
               quantile: float = 99.9) -> dict:
    """The automatic MIAD floor (module docstring): the lowest clock (MHz) at which the
    prefill of the `quantile` prompt length of `input_len` fits (1 − threshold)·TTFT SLO
    on the latency-vs-clock curve (`gpu_model.llm_request`); the maximum if none does.
    `perf` has `prefill_ms(tokens)` at the maximum clock (a `WorkerPerf`)."""
    lens = np.asarray(input_len, dtype=float)
    if lens.size == 0:
        raise ValueError("auto MIAD floor: the trace has no requests")
    if ttft_slo_ms <= 0 or not 0 <= threshold < 1:
        raise ValueError("auto MIAD floor: need ttft_slo_ms > 0 and 0 <= threshold < 1")
    tokens = int(np.percentile(lens, quantile, method="inverted_cdf"))  # nearest rank, as planner.percentile
    pre = float(perf.prefill_ms(tokens))
    work = gpu_model.llm_request(pre, 0.0)
    budget = (1.0 - threshold) * ttft_slo_ms
    mhz = next((f for f in range(spec.min_mhz, spec.max_mhz + 1) if work.at(spec.frac(f)) <= budget), spec.max_mhz)
    return {"mhz": int(mhz), "quantile": quantile, "prompt_tokens": tokens, "prefill_ms_at_max": pre,
            "budget_ms": budget, "prefill_ms_at_floor": work.at(spec.frac(mhz))}


@dataclass
class _Window:
    """One worker's recent samples for MIAD."""

    ttft: deque  # (t, ttft_ms)
    steps: deque  # (t_end, duration_ms, base_prefill_ms, base_decode_ms, decoded)


class ClockControl:
    """MIAD (or a pinned maximum clock) on every worker, every `period_s`."""

    def __init__(self, spec: gpu_model.GpuClockSpec, mode: str, *, ttft_slo_ms: float, atgt_slo_ms: float,
                 step_mhz: int = 100, threshold: float = 0.05, window_s: float = 2.0, quantile: float = 99.0,
                 min_mhz: int = 0, scale_out_after: int = 4):
        if mode not in CLOCK_MODES:
            raise ValueError(f"clock {mode!r} is unknown; choose one of {', '.join(CLOCK_MODES)}")
        if window_s <= 0 or not 0 < quantile <= 100:
            raise ValueError("miad window_s must be > 0 and quantile in (0, 100]")
        lo = spec.max_mhz if mode == "max" else max(spec.min_mhz, min_mhz or spec.min_mhz)
        if lo > spec.max_mhz:
            raise ValueError(f"miad min_mhz {min_mhz} is above the GPU's maximum {spec.max_mhz} MHz")
        self.spec, self.mode = spec, mode
        self.cfg = MiadConfig(min_mhz=lo, max_mhz=spec.max_mhz, step_mhz=step_mhz, threshold=threshold,
                              scale_out_after=scale_out_after)
        self.ttft_slo_ms, self.atgt_slo_ms = ttft_slo_ms, atgt_slo_ms
        self.window_s, self.quantile = window_s, quantile
        self.states: dict[str, MiadState] = {}
        self.windows: dict[str, _Window] = {}
        self.signals: dict[str, ClockSignal] = {}  # scale-out signals since the planner last looked
        self.decisions = {"up": 0, "down": 0, "same": 0, "scale_out": 0}

    def mhz(self, worker_id: str) -> int:
        st = self.states.get(worker_id)
        return st.freq_mhz if st is not None else self.cfg.max_mhz

    def _win(self, worker_id: str) -> _Window:
        w = self.windows.get(worker_id)
        if w is None:
            w = self.windows[worker_id] = _Window(deque(), deque())
            self.states[worker_id] = initial_state(self.cfg)
        return w

    def first_token(self, worker_id: str, t: float, ttft_ms: float) -> None:
        self._win(worker_id).ttft.append((t, ttft_ms))

    def step_done(self, worker_id: str, t_end: float, duration_ms: float, base_prefill_ms: float,
                  base_decode_ms: float, decoded: bool) -> None:
        self._win(worker_id).steps.append((t_end, duration_ms, base_prefill_ms, base_decode_ms, decoded))

    def tick(self, worker_id: str, now: float, live_ttft_ms: list[float] = ()) -> int:
        """One MIAD iteration for a worker; its new clock (MHz). `live_ttft_ms`: the TTFTs
        its requests without a first token yet will have at least (see the module doc)."""
        win = self._win(worker_id)
        t0 = now - self.window_s
        while win.ttft and win.ttft[0][0] < t0:
            win.ttft.popleft()
        while win.steps and win.steps[0][0] < t0:
            win.steps.popleft()
        ttft = percentile([v for _, v in win.ttft] + list(live_ttft_ms), self.quantile)
        dec = [d for _, d, _, _, decoded in win.steps if decoded]
        atgt = sum(dec) / len(dec) if dec else None
        state = self.states[worker_id]
        x = self.spec.frac(state.freq_mhz)
        pre_b = sum(s[2] for s in win.steps)
        dec_b = sum(s[3] for s in win.steps)
        weight = gpu_model.llm_request(pre_b, dec_b).elasticity(x) if pre_b + dec_b > 0 else 1.0
        parts = (PartitionObs(f"{worker_id}/ttft", self.ttft_slo_ms, ttft, 1.0),
                 PartitionObs(f"{worker_id}/atgt", self.atgt_slo_ms, atgt, weight))
        new, d = miad_step(state, parts, self.cfg)
        self.states[worker_id] = new
        self.decisions[d.action] += 1
        if d.scale_out:
            self.decisions["scale_out"] += 1
            self.signals[worker_id] = ClockSignal(gpu_id=worker_id, scale_out=True, missing=(worker_id,),
                                                  at_max=True)
        return new.freq_mhz

    def forget(self, worker_id: str) -> None:
        self.windows.pop(worker_id, None)
        self.signals.pop(worker_id, None)

    def take_signals(self) -> list[ClockSignal]:
        out, self.signals = list(self.signals.values()), {}
        return out
