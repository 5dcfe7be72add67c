"""How the simulated cluster grows, shrinks and clocks its workers: the planner's own
autoscaler objects every `planner_period_s` (`simulator.autoscale.PlannerLoop`), the
release of idle workers opened by Aladdin's scale-out signal (`autoscale`), and µ-Serve's
per-worker SM clocks (`simulator.power.ClockControl`, MIAD every `clock_period_s`).
A mixin of `cluster.Cluster`, which holds the state it reads (`cfg`, `workers`, `perf`,
`spec`, `clock`, `planner`, `counters`, `timeline`, `clock_series`) and the event helpers
it calls (`_live`, `_open`, `_stop`, `_up`, `_route`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from polyserve.core.perf import WorkerPerf
from polyserve.planner.autoscalers import WorkerLoad, least_busy
from polyserve.simulator import autoscale as auto
from polyserve.simulator import power as pw
from polyserve.simulator.config import SimConfig
from polyserve.simulator.engine import SimWorker

if TYPE_CHECKING:
    from polyserve.gpu_agent.gpu_model import GpuClockSpec
    from polyserve.simulator.engine import _Step
    from polyserve.simulator.trace import Trace


def make_clock(cfg: SimConfig, spec: GpuClockSpec, perf: WorkerPerf,
               input_len: np.ndarray) -> tuple[pw.ClockControl | None, dict | None]:
    """The clock control of a run (None: every worker at the maximum clock) and, with
    ``miad_min_mhz="auto"``, the floor `power.auto_floor` chose. µ-Serve's scaler needs
    the clock signal, so it pins a "max" clock control when `clock` is unset."""
    clock = cfg.clock or ("max" if cfg.autoscaler and auto.canonical(cfg.autoscaler) == "muserve" else "")
    floor: dict | None = None
    floor_mhz = cfg.miad_min_mhz
    if floor_mhz == "auto":
        floor = pw.auto_floor(spec, perf, input_len, cfg.ttft_slo_ms,
                              threshold=cfg.miad_threshold, quantile=cfg.miad_floor_quantile)
        floor_mhz = floor["mhz"]
    if not clock:
        return None, floor
    return pw.ClockControl(spec, clock, ttft_slo_ms=cfg.ttft_slo_ms, atgt_slo_ms=cfg.atgt_slo_ms,
                           step_mhz=cfg.miad_step_mhz, threshold=cfg.miad_threshold,
                           window_s=cfg.miad_window_s, quantile=cfg.miad_quantile,
                           min_mhz=floor_mhz, scale_out_after=cfg.scale_out_after), floor


def make_planner(cfg: SimConfig, trace: Trace) -> tuple[auto.PlannerLoop | None, auto.Thresholds | None]:
    """The planner loop around the named autoscaler and its thresholds (None, None without one)."""
    if not cfg.autoscaler:
        return None, None
    th = auto.auto_thresholds(trace.output_len, cfg.ttft_slo_ms, cfg.atgt_slo_ms,
                              cfg.threshold_factor, cfg.pertoken_threshold_ms,
                              cfg.request_threshold_ms, cfg.tracking_slo_ms)
    scaler = auto.make_scaler(cfg.autoscaler, min_workers=cfg.workers, max_workers=cfg.max_workers,
                              th=th, window_s=cfg.scaler_window_s,
                              stabilization_s=cfg.stabilization_s, max_step=cfg.scaler_max_step,
                              tracking_metric=cfg.tracking_metric,
                              up_at=cfg.tracking_up_at, down_below=cfg.tracking_down_below,
                              hold_s=cfg.tracking_hold_s, muserve_idle_release_s=cfg.muserve_idle_release_s)
    return auto.PlannerLoop(scaler, cfg.scaler_window_s, cfg.reset_window_on_scale), th


class Scaling:
    """Planner decisions, idle release and clock control over the cluster's workers."""

    cfg: SimConfig
    workers: dict[str, SimWorker]
    perf: WorkerPerf
    spec: GpuClockSpec
    clock: pw.ClockControl | None
    planner: auto.PlannerLoop | None
    counters: dict
    timeline: list[tuple[float, int]]
    clock_series: list[tuple[float, float, int, int, int]]

    # ------------------------------------------------------------------ clocks
    def _clock_tick(self, now: float) -> None:
        mhz = []
        for w in self.workers.values():
            if w.stopped_at is None and w.ready_at <= now:
                f = self.clock.tick(w.id, now, self._live_ttft_ms(w, now))
                w.clock_x = self.spec.frac(f)
                mhz.append(f)
        if mhz:
            self.clock_series.append((now, sum(mhz) / len(mhz), min(mhz), max(mhz), len(mhz)))

    def _clock_step(self, w: SimWorker, st: _Step, now: float) -> None:
        """Tell the clock control about `w`'s step `st`, which ended at `now`, and its first tokens."""
        self.clock.step_done(w.id, now, st.duration_ms, st.base_prefill_ms, st.base_decode_ms, st.decoded)
        for r in st.new:
            if r.first_token == st.t0 + st.prefill_ms / 1000.0:
                self.clock.first_token(w.id, r.first_token, (r.first_token - r.arrival) * 1000.0)

    def _live_ttft_ms(self, w: SimWorker, now: float) -> list[float]:
        """Lower bounds of the TTFTs of `w`'s requests without a first token (power module doc)."""
        out = []
        st = w.step
        if st is not None:
            t_first = st.t0 + st.prefill_ms / 1000.0
            out += [(t_first - r.arrival) * 1000.0 for r in st.new if r.first_token < 0]
        if w.waiting:
            x = max(w.clock_x, 1e-6)
            out += [(now - r.arrival) * 1000.0 + self.perf.prefill_ms(r.prefill_len) / x
                    for _, _, r in w.waiting if r.first_token < 0]
        return out

    # ------------------------------------------------------------------ the planner's autoscalers
    def _plan(self, now: float) -> None:
        up = self._live()
        ready = [w for w in up if w.ready_at <= now]
        starting = [w for w in up if w.ready_at > now]
        signals = self.clock.take_signals() if self.clock is not None else []
        live = []
        if self.cfg.live_pertoken and auto.canonical(self.cfg.autoscaler) == "pertoken":
            live = [auto.Sample(ts=now, e2e_ms=(now - r.arrival) * 1000.0, output_tokens=w.generated_of(r),
                                ttft_ms=(r.first_token - r.arrival) * 1000.0)
                    for w in ready for r in w.running.values() if w.generated_of(r) > 0]
        out = self.planner.observe(now, [WorkerLoad(w.id, float(w.in_flight())) for w in ready], len(starting),
                                   signals, live)
        current = len(up)
        if out.desired > current:
            for _ in range(min(out.desired, self.cfg.max_workers) - current):
                self.counters["scale_outs"] += 1
                self._open(now, now + self.cfg.cold_start_s)
        elif out.desired < current:
            k = current - out.desired
            named = [self.workers[x] for x in out.remove if x in self.workers and self.workers[x] in ready]
            order = named + sorted(starting, key=lambda w: w.id, reverse=True)
            loads = [WorkerLoad(w.id, float(w.in_flight())) for w in ready if w not in named]
            order += [self.workers[x] for x in least_busy(loads, len(loads))]
            for w in order[:k]:
                self._remove(w, now)

    def _remove(self, w: SimWorker, now: float) -> None:
        """Stop `w`: no new requests, its queue back to the dispatcher, stopped when idle."""
        w.draining = True
        self.counters["released"] += 1
        queued = [r for _, _, r in sorted(w.waiting, key=lambda e: (e[0], e[1]))]
        w.waiting.clear()
        for r in queued:
            r.worker = ""
            self._route(r, now)
        if w.ready_at > now or w.idle():
            self._stop(w, now)

    # ------------------------------------------------------------------ Aladdin's scale-out signal
    def _release_idle(self, now: float) -> None:
        """With `autoscale`: release workers idle for `idle_release_s`, newest first, down to `workers`."""
        cfg = self.cfg
        live = self._live()
        for w in sorted(live, key=lambda w: w.id, reverse=True):
            if len(live) <= cfg.workers:
                break
            if w.idle() and now - w.idle_since >= cfg.idle_release_s and w.ready_at <= now:
                w.stopped_at = now
                live.remove(w)
                self.counters["released"] += 1
                self.timeline.append((now, self._up()))
