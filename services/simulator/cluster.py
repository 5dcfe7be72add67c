"""The discrete-event cluster: arrivals from a trace, placement by the dispatcher's own
policies (`polyserve.dispatcher.policy.POLICIES`, Aladdin's `place`/`rebalance`), queue
order by the worker's own order keys (`polyserve.core.queue_order.ORDER_KEYS`), workers
from `engine.SimWorker`, events on a heap.

Placement names: every name in `POLICIES`, plus ``aladdin_rebalance`` (Aladdin Alg. 1
with Alg. 2 re-balancing every `rebalance_s`). With `autoscale`, Aladdin's scale-out
signal (no worker passes Alg. 1) opens a worker (ready after `cold_start_s`), and a
worker idle for `idle_release_s` is released, down to `workers`; other policies never
signal, so they keep `workers` fixed.

With `autoscaler` (``pertoken``, ``request``, ``tracking``, ``muserve``) the planner's
own autoscaler objects decide every `planner_period_s` instead (`simulator.autoscale`),
starting `workers` (the minimum). With `clock` (``max`` | ``miad``) every worker has an
SM clock, MIAD runs every `clock_period_s` (`simulator.power`); energy is accounted in
every run (at the maximum clock when `clock` is unset). All of it is SIMULATED.
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from polyserve.core.perf import PerfFitter, WorkerPerf
from polyserve.core.queue_order import ORDER_KEYS, ssjf_key
from polyserve.dispatcher import policy_aladdin as aladdin
from polyserve.dispatcher.policy import POLICIES, PolicyState, RequestView, RunningRequest, WorkerView
from polyserve.planner.autoscalers import WorkerLoad, least_busy
from polyserve.simulator import autoscale as auto
from polyserve.simulator import power as pw
from polyserve.simulator.engine import SimRequest, SimWorker, WorkerConfig
from polyserve.simulator.predictor import ConditionalMean, LengthPredictor
from polyserve.simulator.trace import Adapters, Trace

SIM_POLICIES = (*POLICIES, "aladdin_rebalance")
NEEDS_REQUESTS = {"aladdin", "aladdin_rebalance", "caraserve"}
# Event kinds, in their order at equal times. Arrivals at time t are handled before any
# event at t, and an idle worker is started by a _KICK at t, so requests arriving together
# (or exactly at a step boundary) join the same step.
_STEP, _KICK, _READY, _TICK, _CLOCK, _PLAN = 0, 1, 2, 3, 4, 5


@dataclass
class SimConfig:
    """One simulated run (see the module docstring)."""

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
    rebalance_s: float = 0.25
    tick_s: float = 1.0
    max_input_len: int = 0  # 0 = no limit
    aging_s: float = 0.0  # ssjf aging period (s per length class); 0 = the worker's default
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
    extra: dict = field(default_factory=dict)  # energy, clocks, autoscaler record (see Cluster.run)


class Cluster:
    """Runs one `SimConfig` over a trace."""

    def __init__(self, trace: Trace, perf: WorkerPerf, cfg: SimConfig, *, predictor: LengthPredictor | None = None,
                 adapters: Adapters | None = None, adapter_idx: np.ndarray | None = None,
                 policy_perf: WorkerPerf | None = None):
        cfg.validate()
        self.trace, self.perf, self.cfg = trace, perf, cfg
        self.predictor = predictor
        self.adapters, self.adapter_idx = adapters, adapter_idx
        self.fitter = PerfFitter(policy_perf or perf) if cfg.fit_online else None
        self.policy_perf = policy_perf or perf
        self.order_key = ORDER_KEYS[cfg.order]
        if cfg.order == "ssjf" and cfg.aging_s > 0:
            self.order_key = lambda r, _a=cfg.aging_s: ssjf_key(r, _a)
        self.acfg = aladdin.AladdinConfig(ttft_slo_ms=cfg.ttft_slo_ms, atgt_slo_ms=cfg.atgt_slo_ms, gamma=cfg.gamma,
                                          theta=cfg.theta, slack=cfg.slack,
                                          repredict=ConditionalMean(trace.output_len))
        self.rng = random.Random(cfg.seed)
        self.state = PolicyState()
        self.ledger = aladdin.ErrorLedger()
        self.workers: dict[str, SimWorker] = {}
        self.events: list = []
        self._seq = 0
        self._n_made = 0
        self.timeline: list[tuple[float, int]] = []
        self.counters = {"scale_outs": 0, "released": 0, "moves": 0, "rejected": 0, "no_fit": 0, "aborted": False}
        self.misses = 0
        self._missed: set[int] = set()
        self.spec = pw.gpu_spec(cfg.gpu)
        self.meter = pw.PowerMeter(self.spec, cfg.worker.tp, cfg.power_bin_s)
        clock = cfg.clock or ("max" if cfg.autoscaler and auto.canonical(cfg.autoscaler) == "muserve" else "")
        self.floor: dict | None = None
        floor_mhz = cfg.miad_min_mhz
        if floor_mhz == "auto":
            self.floor = pw.auto_floor(self.spec, perf, trace.input_len, cfg.ttft_slo_ms,
                                       threshold=cfg.miad_threshold, quantile=cfg.miad_floor_quantile)
            floor_mhz = self.floor["mhz"]
        self.clock = pw.ClockControl(self.spec, clock, ttft_slo_ms=cfg.ttft_slo_ms, atgt_slo_ms=cfg.atgt_slo_ms,
                                     step_mhz=cfg.miad_step_mhz, threshold=cfg.miad_threshold,
                                     window_s=cfg.miad_window_s, quantile=cfg.miad_quantile,
                                     min_mhz=floor_mhz, scale_out_after=cfg.scale_out_after) if clock else None
        self.clock_series: list[tuple[float, float, int, int, int]] = []  # (t, mean, min, max MHz, workers)
        self.planner: auto.PlannerLoop | None = None
        self.thresholds: auto.Thresholds | None = None
        if cfg.autoscaler:
            self.thresholds = auto.auto_thresholds(trace.output_len, cfg.ttft_slo_ms, cfg.atgt_slo_ms,
                                                   cfg.threshold_factor, cfg.pertoken_threshold_ms,
                                                   cfg.request_threshold_ms, cfg.tracking_slo_ms)
            scaler = auto.make_scaler(cfg.autoscaler, min_workers=cfg.workers, max_workers=cfg.max_workers,
                                      th=self.thresholds, window_s=cfg.scaler_window_s,
                                      stabilization_s=cfg.stabilization_s, max_step=cfg.scaler_max_step,
                                      tracking_metric=cfg.tracking_metric,
                                      up_at=cfg.tracking_up_at, down_below=cfg.tracking_down_below,
                                      hold_s=cfg.tracking_hold_s, muserve_idle_release_s=cfg.muserve_idle_release_s)
            self.planner = auto.PlannerLoop(scaler, cfg.scaler_window_s, cfg.reset_window_on_scale)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        t_wall = time.perf_counter()
        tr, cfg = self.trace, self.cfg
        for _ in range(cfg.initial_workers if cfg.autoscaler and cfg.initial_workers else cfg.workers):
            self._open(0.0, ready_at=0.0)
        if self.predictor is not None:
            pred_tok, pred_cls = self.predictor.precompute(tr.output_len)
        else:
            pred_tok, pred_cls = tr.output_len.copy(), np.full(len(tr), -1)
        online = self.predictor is not None and self.predictor.mode == "history"
        arrivals, inputs, outputs = tr.arrival.tolist(), tr.input_len.tolist(), tr.output_len.tolist()
        pred_tok, pred_cls = pred_tok.tolist(), pred_cls.tolist()
        reqs: list[SimRequest] = []
        n, i = len(arrivals), 0
        self._push(cfg.tick_s, _TICK, None)
        if self.clock is not None:
            self._push(cfg.clock_period_s, _CLOCK, None)
        if self.planner is not None:
            self._push(cfg.planner_period_s, _PLAN, None)
        last = 0.0
        while i < n or self.events:
            if self.events and (i >= n or self.events[0][0] < arrivals[i]):
                now, kind, _, obj = heapq.heappop(self.events)
                if kind == _STEP:
                    st = obj.step
                    prefilled = st.new
                    for r in obj.end_step(now):
                        self._finished(obj, r, now, online)
                    self._count_misses(prefilled, now)
                    if self.clock is not None:
                        self.clock.step_done(obj.id, now, st.duration_ms, st.base_prefill_ms, st.base_decode_ms,
                                             st.decoded)
                        for r in prefilled:
                            if r.first_token == st.t0 + st.prefill_ms / 1000.0:
                                self.clock.first_token(obj.id, r.first_token, (r.first_token - r.arrival) * 1000.0)
                    if cfg.abort_misses and self.misses > cfg.abort_misses:
                        self.counters["aborted"] = True
                        break
                    self._kick(obj, now)
                    if obj.draining and obj.idle():
                        self._stop(obj, now)
                elif kind in (_KICK, _READY):
                    self._kick(obj, now)
                else:
                    if i >= n and all(w.idle() for w in self.workers.values()):
                        continue  # nothing left: stop ticking
                    if kind == _TICK:
                        self._tick(now)
                        self._push(now + cfg.tick_s, _TICK, None)
                    elif kind == _CLOCK:
                        self._clock_tick(now)
                        self._push(now + cfg.clock_period_s, _CLOCK, None)
                    else:
                        self._plan(now)
                        self._push(now + cfg.planner_period_s, _PLAN, None)
                last = max(last, now)
                continue
            now = arrivals[i]
            r = SimRequest(idx=i, request_id=f"r{i}", arrival=now, input_len=inputs[i], output_len=outputs[i],
                           predicted_tokens=pred_tok[i], length_class=pred_cls[i])
            if online:
                r.predicted_tokens, r.length_class = self.predictor.predict_online(r.input_len)
            if self.adapters is not None:
                a = int(self.adapter_idx[i])
                r.adapter, r.rank = self.adapters.names[a], int(self.adapters.ranks[a])
            reqs.append(r)
            self._arrive(r, now)
            i += 1
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
        self.counters["workers_opened"] = self._n_made
        conf = asdict(cfg)
        extra = self._extra(tr, horizon)
        return RunResult(conf, reqs, horizon, gpu_s, peak, self.timeline, self.counters,
                         time.perf_counter() - t_wall, self.fitter.errors() if self.fitter else None, extra)

    def _extra(self, tr: Trace, horizon: float) -> dict:
        """Energy (always), clocks (with `clock`), the autoscaler's record (with `autoscaler`)."""
        cfg = self.cfg
        ups = [(w.started_at, w.stopped_at) for w in self.workers.values()]
        out: dict = {"gpu": self.spec.name, "tdp_w": self.spec.tdp_w,
                     "clock_mode": self.clock.mode if self.clock else "fixed-max", **self.meter.finish(ups, horizon)}
        if self.clock is not None:
            cs = np.array(self.clock_series) if self.clock_series else np.zeros((0, 5))
            busy = cs[:, 4] > 0
            out.update(clock_t=cs[:, 0].tolist(), clock_mean_mhz=cs[:, 1].tolist(), clock_min_mhz=cs[:, 2].tolist(),
                       clock_max_mhz=cs[:, 3].tolist(),
                       clock_avg_mhz=float(cs[busy, 1].mean()) if busy.any() else float(self.spec.max_mhz),
                       miad_decisions=dict(self.clock.decisions), miad_floor_mhz=self.clock.cfg.min_mhz)
            if self.floor is not None:
                out["miad_auto_floor"] = self.floor
        if self.planner is not None:
            pl = self.planner
            rise = tr.step_s if tr.step_s is not None else auto.load_rise(tr.arrival, cfg.planner_period_s,
                                                                          cfg.rise_factor)
            first = pl.first_scale_out
            out.update(autoscaler=pl.scaler.name, scaler=auto.scaler_threshold(pl.scaler),
                       first_scale_out_s=first, load_rise_s=rise,
                       scale_out_after_rise_s=(first - rise) if first is not None and rise is not None else None,
                       rise_to_scale_out_s=pl.first_scale_out_since(rise) - rise
                       if rise is not None and pl.first_scale_out_since(rise) is not None else None,
                       scale_outs=pl.scale_outs, scale_ins=pl.scale_ins,
                       decisions=[(t, c, d) for t, c, d, _ in pl.decisions],
                       reasons=[r for *_, r in pl.decisions][-3:])
        return out

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, kind, self._seq, obj))

    def _kick(self, w: SimWorker, now: float) -> None:
        if w.step is None and now >= w.ready_at:
            end = w.start_step(now)
            if end is not None:
                self.meter.step(now, end - now, self.clock.mhz(w.id) if self.clock else self.spec.max_mhz)
                if self.fitter is not None and w.steps % 16 == 0:
                    self._observe_step(w)
                self._push(end, _STEP, w)

    def _open(self, now: float, ready_at: float) -> SimWorker:
        self._n_made += 1
        w = SimWorker(f"w{self._n_made:03d}", self.perf, self.cfg.worker, self.order_key, started_at=now)
        w.ready_at = ready_at
        self.workers[w.id] = w
        self.timeline.append((now, self._up()))
        if ready_at > now:
            self._push(ready_at, _READY, w)
        return w

    def _up(self) -> int:
        return sum(1 for w in self.workers.values() if w.stopped_at is None)

    def _live(self) -> list[SimWorker]:
        """Workers that take requests: started (maybe still cold-starting), not stopping."""
        return [w for w in self.workers.values() if w.stopped_at is None and not w.draining]

    def _stop(self, w: SimWorker, now: float) -> None:
        w.stopped_at = now
        if self.clock is not None:
            self.clock.forget(w.id)
        self.timeline.append((now, self._up()))

    # ------------------------------------------------------------------ clocks and the planner
    def _clock_tick(self, now: float) -> None:
        mhz = []
        for w in self.workers.values():
            if w.stopped_at is None and w.ready_at <= now:
                f = self.clock.tick(w.id, now, self._live_ttft_ms(w, now))
                w.clock_x = self.spec.frac(f)
                mhz.append(f)
        if mhz:
            self.clock_series.append((now, sum(mhz) / len(mhz), min(mhz), max(mhz), len(mhz)))

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

    def _route(self, r: SimRequest, now: float) -> None:
        """Place a request on the worker the policy chooses (and start it if it is idle)."""
        w = self._choose(r, now)
        if not w.enqueue(r, now):
            self.counters["rejected"] += 1
            self.misses += 1
            return
        if w.step is None:
            self._push(now, _KICK, w)

    def _arrive(self, r: SimRequest, now: float) -> None:
        cfg = self.cfg
        if cfg.max_input_len and r.input_len > cfg.max_input_len:
            r.rejected = f"input longer than max_input_len={cfg.max_input_len}"
            self.counters["rejected"] += 1
            self.misses += 1
            return
        self._route(r, now)

    def _choose(self, r: SimRequest, now: float) -> SimWorker:
        cfg = self.cfg
        live = self._live()
        ready = [w for w in live if w.ready_at <= now] or live
        rv = RequestView(request_id=r.request_id, input_tokens=r.input_len, predicted_tokens=r.predicted_tokens,
                         length_class=r.length_class, adapter=r.adapter, adapter_rank=r.rank,
                         ttft_slo_ms=cfg.ttft_slo_ms, atgt_slo_ms=cfg.atgt_slo_ms)
        detail = cfg.policy in NEEDS_REQUESTS
        views = [self._view(w, now, detail) for w in ready]
        if cfg.policy.startswith("aladdin"):
            p = aladdin.place(views, rv, self.acfg)
            if p.worker_id is not None:
                return self.workers[p.worker_id]
            self.counters["no_fit"] += 1
            if cfg.autoscale:
                # A worker still cold-starting takes what fits on it (its queue counts as
                # not-yet-started requests), so one shortfall opens one worker, not one each.
                starting = [w for w in live if w.ready_at > now]
                if starting and len(starting) < len(live):
                    q = aladdin.place([self._view(w, now, detail) for w in starting], rv, self.acfg)
                    if q.worker_id is not None:
                        return self.workers[q.worker_id]
                if len(live) < cfg.max_workers:
                    self.counters["scale_outs"] += 1
                    return self._open(now, now + cfg.cold_start_s)
            # no new worker: the policy's own fallback (the emptiest worker)
            return self.workers[POLICIES["aladdin"](views, rv, self.state, self.rng).worker_id]
        d = POLICIES[cfg.policy](views, rv, self.state, self.rng)
        self.state = d.state
        return self.workers[d.worker_id]

    def _view(self, w: SimWorker, now: float, detail: bool) -> WorkerView:
        reqs: tuple[RunningRequest, ...] = ()
        if detail:
            out = [RunningRequest(request_id=r.request_id, input_tokens=r.input_len,
                                  predicted_tokens=r.predicted_tokens, generated=w.generated_of(r),
                                  decode_ms=(now - r.first_token) * 1000.0, adapter=r.adapter, rank=r.rank)
                   for r in w.running.values()]
            if w.step is not None:
                out += [RunningRequest(request_id=r.request_id, input_tokens=r.input_len,
                                       predicted_tokens=r.predicted_tokens, generated=0, adapter=r.adapter,
                                       rank=r.rank) for r in w.step.new]
            out += [RunningRequest(request_id=r.request_id, input_tokens=r.input_len,
                                   predicted_tokens=r.predicted_tokens, generated=r.generated, started=False,
                                   adapter=r.adapter, rank=r.rank) for _, _, r in w.waiting]
            reqs = tuple(out)
        l_e, b_e = self.ledger.errors(w.id, now) if self.cfg.policy == "aladdin_rebalance" else (0.0, 0.0)
        names = tuple(w.adapters)
        wc = self.cfg.worker
        return WorkerView(worker_id=w.id, outstanding=w.in_flight(), running=w.b, waiting=len(w.waiting),
                          kv_used=w.kv_used(), kv_capacity=wc.kv_capacity, adapters=names,
                          adapter_ranks=tuple(w.adapters[a] for a in names), max_adapters=wc.max_adapters,
                          kernel=wc.kernel, max_batch=wc.max_batch, requests=reqs, perf=self.policy_perf,
                          len_error=l_e, batch_error=b_e)

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

    def _tick(self, now: float) -> None:
        cfg = self.cfg
        if self.fitter is not None:
            self.policy_perf = self.fitter.current()
        if cfg.policy == "aladdin_rebalance" and any(w.waiting for w in self._live()):
            self._rebalance(now)
        if cfg.autoscale:
            live = self._live()
            for w in sorted(live, key=lambda w: w.id, reverse=True):
                if len(live) <= cfg.workers:
                    break
                if w.idle() and now - w.idle_since >= cfg.idle_release_s and w.ready_at <= now:
                    w.stopped_at = now
                    live.remove(w)
                    self.counters["released"] += 1
                    self.timeline.append((now, self._up()))

    def _rebalance(self, now: float) -> None:
        live = [w for w in self._live() if w.ready_at <= now]
        views = [self._view(w, now, True) for w in live]
        for mv in aladdin.rebalance(views, self.acfg):
            src, dst = self.workers[mv.src], self.workers[mv.dst]
            r = src.remove_waiting(mv.request_id)
            if r is not None and dst.enqueue(r, now):
                self.counters["moves"] += 1
                if dst.step is None:
                    self._push(now, _KICK, dst)

    def _observe_step(self, w: SimWorker) -> None:
        st, perf = w.step, self.perf
        if st.new:
            self.fitter.observe_prefill(sum(r.prefill_len for r in st.new), st.prefill_ms)
        if st.decoded and w.b:
            l_avg = (w.S + w.b * w.D) / w.b
            ms = perf.decode_ms(l_avg, w.b) + perf.lora_ms(w.cfg.kernel, w.b, w.max_rank(), w.sum_rank)
            self.fitter.observe_decode(l_avg, w.b, ms, kernel=w.cfg.kernel, max_rank=w.max_rank(),
                                       sum_rank=w.sum_rank)


def simulate(trace: Trace, perf: WorkerPerf, cfg: SimConfig, **kw) -> RunResult:
    """Run `cfg` over `trace` with true timings from `perf` (see `Cluster` for the options)."""
    return Cluster(trace, perf, cfg, **kw).run()


def with_worker(cfg: SimConfig, **worker_fields) -> SimConfig:
    """`cfg` with some WorkerConfig fields changed."""
    return replace(cfg, worker=replace(cfg.worker, **worker_fields))
