"""What the simulated cluster records: SLO misses as they happen (for `abort_misses`),
completions fed to the planner, the length predictor and Aladdin's error ledger, step
timings fed to the online perf fit (`fit_online`), and at the end the run's footprint
(GPU-seconds, peak, counters), energy, clocks and the autoscaler's record (`RunResult`).
A mixin of `cluster.Cluster`, which holds the state it reads (`cfg`, `trace`, `perf`,
`workers`, `predictor`, `planner`, `clock`, `meter`, `spec`, `fitter`, `ledger`,
`counters`, `timeline`, `clock_series`, `floor`).
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np

from polyserve.simulator import autoscale as auto
from polyserve.simulator.config import RunResult, SimConfig
from polyserve.simulator.engine import SimRequest, SimWorker

if TYPE_CHECKING:
    from polyserve.core.perf import PerfFitter, WorkerPerf
    from polyserve.dispatcher import policy_aladdin as aladdin
    from polyserve.gpu_agent.gpu_model import GpuClockSpec
    from polyserve.simulator import power as pw
    from polyserve.simulator.predictor import LengthPredictor
    from polyserve.simulator.trace import Trace


class Accounting:
    """SLO misses, completions, online fits and the run's result."""

    cfg: SimConfig
    trace: Trace
    perf: WorkerPerf
    workers: dict[str, SimWorker]
    predictor: LengthPredictor | None
    planner: auto.PlannerLoop | None
    clock: pw.ClockControl | None
    meter: pw.PowerMeter
    spec: GpuClockSpec
    fitter: PerfFitter | None
    ledger: aladdin.ErrorLedger
    counters: dict
    timeline: list[tuple[float, int]]
    clock_series: list[tuple[float, float, int, int, int]]
    floor: dict | None
    misses: int
    _missed: set[int]
    _n_made: int

    # ------------------------------------------------------------------ during the run
    def _count_misses(self, prefilled: list[SimRequest], now: float) -> None:
        """Requests that missed an SLO so far (for `abort_misses`): TTFT at the first token."""
        slo = self.cfg.ttft_slo_ms / 1000.0
        for r in prefilled:
            if r.first_token - r.arrival > slo and r.idx not in self._missed:
                self._missed.add(r.idx)
                self.misses += 1

    def _finished(self, w: SimWorker, r: SimRequest, now: float, online: bool) -> None:
        if self.planner is not None:
            self.planner.completed(r.finish, (r.finish - r.arrival) * 1000.0, r.output_len,
                                   (r.first_token - r.arrival) * 1000.0)
        if r.output_len > 1 and r.idx not in self._missed and \
                (r.finish - r.first_token) * 1000.0 / (r.output_len - 1) > self.cfg.atgt_slo_ms:
            self._missed.add(r.idx)
            self.misses += 1
        if online:
            self.predictor.observe(r.input_len, r.output_len)
        if self.cfg.policy == "aladdin_rebalance" and r.predicted_tokens:
            step = self.perf.decode_ms((w.S + w.b * w.D) / w.b, w.b) if w.b else self.cfg.atgt_slo_ms
            self.ledger.finished(w.id, r.predicted_tokens, r.output_len, now, step)

    def _observe_step(self, w: SimWorker) -> None:
        st, perf = w.step, self.perf
        if st.new:
            self.fitter.observe_prefill(sum(r.prefill_len for r in st.new), st.prefill_ms)
        if st.decoded and w.b:
            l_avg = (w.S + w.b * w.D) / w.b
            ms = perf.decode_ms(l_avg, w.b) + perf.lora_ms(w.cfg.kernel, w.b, w.max_rank(), w.sum_rank)
            self.fitter.observe_decode(l_avg, w.b, ms, kernel=w.cfg.kernel, max_rank=w.max_rank(),
                                       sum_rank=w.sum_rank)

    # ------------------------------------------------------------------ at the end
    def _result(self, reqs: list[SimRequest], last: float, t_wall: float) -> RunResult:
        """Close the run at its horizon (the last event or completion) and sum it up."""
        cfg = self.cfg
        horizon = max([last] + [r.finish for r in reqs])
        self.counters["slo_misses"] = self.misses
        for w in self.workers.values():
            if w.stopped_at is None:
                w.stopped_at = horizon
        tp = cfg.worker.tp
        gpu_s = sum((w.stopped_at - w.started_at) * tp for w in self.workers.values())
        peak = max((c for _, c in self.timeline), default=cfg.workers) * tp
        self.counters["preemptions"] = sum(w.preemptions for w in self.workers.values())
        self.counters["kv_overflows"] = sum(w.kv_overflows for w in self.workers.values())
        self.counters["refine_preemptions"] = sum(w.refine_preemptions for w in self.workers.values())
        self.counters["paused_kv_dropped"] = sum(w.paused_dropped for w in self.workers.values())
        # by the overtake bound or the tail guard
        self.counters["overdue_promoted"] = sum(w.promoted for w in self.workers.values())
        self.counters["workers_opened"] = self._n_made
        conf = asdict(cfg)
        extra = self._extra(self.trace, horizon)
        return RunResult(conf, reqs, horizon, gpu_s, peak, self.timeline, self.counters,
                         time.perf_counter() - t_wall, self.fitter.errors() if self.fitter else None, extra)

    def _extra(self, tr: Trace, horizon: float) -> dict:
        """Energy (always), clocks (with `clock`), the autoscaler's record (with `autoscaler`)."""
        ups = [(w.started_at, w.stopped_at) for w in self.workers.values()]
        out: dict = {"gpu": self.spec.name, "tdp_w": self.spec.tdp_w,
                     "clock_mode": self.clock.mode if self.clock else "fixed-max", **self.meter.finish(ups, horizon)}
        if self.clock is not None:
            out.update(self._clock_record())
        if self.planner is not None:
            out.update(self._planner_record(tr))
        return out

    def _clock_record(self) -> dict:
        cs = np.array(self.clock_series) if self.clock_series else np.zeros((0, 5))
        busy = cs[:, 4] > 0
        out = {"clock_t": cs[:, 0].tolist(), "clock_mean_mhz": cs[:, 1].tolist(),
               "clock_min_mhz": cs[:, 2].tolist(), "clock_max_mhz": cs[:, 3].tolist(),
               "clock_avg_mhz": float(cs[busy, 1].mean()) if busy.any() else float(self.spec.max_mhz),
               "miad_decisions": dict(self.clock.decisions), "miad_floor_mhz": self.clock.cfg.min_mhz}
        if self.floor is not None:
            out["miad_auto_floor"] = self.floor
        return out

    def _planner_record(self, tr: Trace) -> dict:
        """The autoscaler's decisions and how long after the load rise it first scaled out."""
        pl, cfg = self.planner, self.cfg
        rise = tr.step_s if tr.step_s is not None else auto.load_rise(tr.arrival, cfg.planner_period_s,
                                                                      cfg.rise_factor)
        first = pl.first_scale_out
        since = pl.first_scale_out_since(rise) if rise is not None else None
        return {"autoscaler": pl.scaler.name, "scaler": auto.scaler_threshold(pl.scaler),
                "first_scale_out_s": first, "load_rise_s": rise,
                "scale_out_after_rise_s": (first - rise) if first is not None and rise is not None else None,
                "rise_to_scale_out_s": since - rise if since is not None else None,
                "scale_outs": pl.scale_outs, "scale_ins": pl.scale_ins,
                "decisions": [(t, c, d) for t, c, d, _ in pl.decisions],
                "reasons": [r for *_, r in pl.decisions][-3:]}
