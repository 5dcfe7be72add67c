"""The discrete-event cluster: arrivals from a trace, placement by the dispatcher's own
policies (`polyserve.dispatcher.policy.POLICIES`, Aladdin's `place`/`rebalance`), queue
order by the worker's own order keys (`polyserve.core.queue_order.ORDER_KEYS`), workers
from `engine.SimWorker`, events on a heap.

Placement names: every name in `POLICIES`, plus ``aladdin_rebalance`` (Aladdin Alg. 1
with Alg. 2 re-balancing every `tick_s`). With `autoscale`, Aladdin's scale-out
signal (no worker passes Alg. 1) opens a worker (ready after `cold_start_s`), and a
worker idle for `idle_release_s` is released, down to `workers`; other policies never
signal, so they keep `workers` fixed.

With `autoscaler` (`polyserve.core.names`' ``pertoken``, ``request``, ``target_tracking``,
``muserve``) the planner's own autoscaler objects decide every `planner_period_s` instead
(`simulator.autoscale`), starting `workers` (the minimum). With `clock` (``max`` | ``miad``)
every worker has an SM clock, MIAD runs every `clock_period_s` (`simulator.power`); energy
is accounted in every run (at the maximum clock when `clock` is unset). All of it is SIMULATED.

The run's options are `config.SimConfig`, its output `config.RunResult`. This module holds
the event loop and the workers' lives; `placement` (routing and views), `scaling` (the
planner's autoscalers, idle release, clocks) and `accounting` (misses, fits, the result)
hold the rest, as mixins of `Cluster`.
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import replace

import numpy as np

from polyserve.core import queue_order as qo
from polyserve.core.perf import PerfFitter, WorkerPerf
from polyserve.core.queue_order import ORDER_KEYS
from polyserve.dispatcher import policy_aladdin as aladdin
from polyserve.dispatcher.policy import POLICIES, PolicyState
from polyserve.simulator import power as pw
from polyserve.simulator.accounting import Accounting
from polyserve.simulator.config import NEEDS_REQUESTS, SIM_POLICIES, RunResult, SimConfig
from polyserve.simulator.engine import SimRequest, SimWorker
from polyserve.simulator.placement import Placement
from polyserve.simulator.predictor import ConditionalMean, LengthPredictor
from polyserve.simulator.scaling import Scaling, make_clock, make_planner
from polyserve.simulator.trace import Adapters, Trace

__all__ = ["NEEDS_REQUESTS", "POLICIES", "SIM_POLICIES", "Cluster", "RunResult", "SimConfig", "simulate",
           "with_worker"]

# Event kinds, in their order at equal times. Arrivals at time t are handled before any
# event at t, and an idle worker is started by a _KICK at t, so requests arriving together
# (or exactly at a step boundary) join the same step.
_STEP, _KICK, _READY, _TICK, _CLOCK, _PLAN = 0, 1, 2, 3, 4, 5
# What handling one event led to (`Cluster._on_event`).
_HANDLED, _IDLE, _ABORT = 0, 1, 2


class Cluster(Placement, Scaling, Accounting):
    """Runs one `SimConfig` over a trace: the event loop and the workers' lives here;
    placement (`placement.Placement`), autoscaling and clocks (`scaling.Scaling`) and the
    bookkeeping and result (`accounting.Accounting`) in the mixins."""

    def __init__(self, trace: Trace, perf: WorkerPerf, cfg: SimConfig, *, predictor: LengthPredictor | None = None,
                 adapters: Adapters | None = None, adapter_idx: np.ndarray | None = None,
                 policy_perf: WorkerPerf | None = None):
        cfg.validate()
        self.trace, self.perf, self.cfg = trace, perf, cfg
        self.predictor = predictor
        self.adapters, self.adapter_idx = adapters, adapter_idx
        self.fitter = PerfFitter(policy_perf or perf) if cfg.fit_online else None
        self.policy_perf = policy_perf or perf
        self.order_key = self._order_key(cfg)
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
        self.clock, self.floor = make_clock(cfg, self.spec, perf, trace.input_len)
        self.clock_series: list[tuple[float, float, int, int, int]] = []  # (t, mean, min, max MHz, workers)
        self.planner, self.thresholds = make_planner(cfg, trace)
        self._online = predictor is not None and predictor.mode == "history"

    @staticmethod
    def _order_key(cfg: SimConfig):
        """The worker's sort key for `cfg.order`, with the run's SJF parameters."""
        if cfg.order == "ssjf_class" and cfg.aging_s > 0:
            return lambda r, _a=cfg.aging_s: qo.ssjf_class_key(r, _a)
        return ORDER_KEYS[cfg.order]  # ssjf: a SizeRule per worker (_new_rule)

    def _refiner(self, w: SimWorker):
        """(request, generated, tokens to prefill) -> its key now, for refine_preempt: ssjf's
        rule on the remaining size E[L − generated | L > generated, predicted class] learned from
        the worker's own completions (`core.queue_order.RemainingEstimator`, as a live worker
        would); sjf_oracle: the true remaining length (SRPT, the honest oracle for a preemptive rule)."""
        if self.cfg.order == "sjf_oracle":
            return lambda r, generated, prefill: qo.srpt_oracle_key(r, generated)
        rule, est = w.rule, w.rule.estimator
        return lambda r, generated, prefill: qo.refined_ssjf_key(rule, est, r, generated, prefill)

    def _new_rule(self) -> qo.SizeRule | None:
        """A worker's own `ssjf` state (its queue's recent sizes and JCTs, the overtake bound of
        `WorkerConfig.overtake_bound`, on by default, and the tail guard of `tail_guard`), as in a
        live worker."""
        cfg = self.cfg
        if cfg.order != "ssjf":
            return None
        return qo.SizeRule(input_weight=cfg.ssjf_input_weight if cfg.ssjf_input_weight >= 0 else qo.INPUT_WEIGHT,
                           window_factor=cfg.ssjf_window_factor or qo.WINDOW_FACTOR,
                           window_s=cfg.ssjf_window_s or qo.WINDOW_S,
                           estimator=qo.RemainingEstimator(by_client=cfg.worker.refine_by_client)
                           if cfg.worker.refine_preempt else None, tail_guard=cfg.worker.tail_guard,
                           overtake_bound=cfg.worker.overtake_bound)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        t_wall = time.perf_counter()
        cfg = self.cfg
        for _ in range(cfg.initial_workers if cfg.autoscaler and cfg.initial_workers else cfg.workers):
            self._open(0.0, ready_at=0.0)
        make = self._request_maker()
        arrivals = self.trace.arrival.tolist()
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
                outcome = self._on_event(now, kind, obj, arrivals_left=i < n)
                if outcome == _ABORT:
                    break
                if outcome == _HANDLED:
                    last = max(last, now)
                continue
            r = make(i)
            reqs.append(r)
            if r.rejected:  # over the context window (_fit_context)
                self.counters["rejected"] += 1
                self.misses += 1
            else:
                self._arrive(r, r.arrival)
            i += 1
        return self._result(reqs, last, t_wall)

    def _request_maker(self):
        """`make(i)`: the trace's i-th request, with its predicted length (and adapter)."""
        tr = self.trace
        if self.predictor is not None:
            pred_tok, pred_cls = self.predictor.precompute(tr.output_len)
        else:
            pred_tok, pred_cls = tr.output_len.copy(), np.full(len(tr), -1)
        arrivals, inputs, outputs = tr.arrival.tolist(), tr.input_len.tolist(), tr.output_len.tolist()
        pred_tok, pred_cls = pred_tok.tolist(), pred_cls.tolist()
        clients = tr.client.tolist() if tr.client is not None else None

        def make(i: int) -> SimRequest:
            r = SimRequest(idx=i, request_id=f"r{i}", arrival=arrivals[i], input_len=inputs[i],
                           output_len=outputs[i], predicted_tokens=pred_tok[i], length_class=pred_cls[i])
            if clients is not None:
                r.client = clients[i]
            self._fit_context(r)
            if self._online:
                r.predicted_tokens, r.length_class = self.predictor.predict_online(r.input_len)
            if self.adapters is not None:
                a = int(self.adapter_idx[i])
                r.adapter, r.rank = self.adapters.names[a], int(self.adapters.ranks[a])
            return r

        return make

    def _fit_context(self, r: SimRequest) -> None:
        """The context window and the profiled range (SimConfig): reject or cut a prompt that
        does not fit, cap an output at what the window leaves; count each case."""
        cfg, c = self.cfg, self.counters
        lim = cfg.context_limit
        if lim and r.input_len >= lim:
            if cfg.over_context == "reject":
                r.rejected = f"prompt of {r.input_len} tokens >= context limit {lim}"
                c["over_context_rejected"] = c.get("over_context_rejected", 0) + 1
                return
            r.input_len = lim - 1
            c["prompt_truncated"] = c.get("prompt_truncated", 0) + 1
        if lim and r.input_len + r.output_len > lim:
            r.output_len = max(1, lim - r.input_len)
            c["output_capped"] = c.get("output_capped", 0) + 1
        if cfg.profiled_prefill_tokens and r.input_len > cfg.profiled_prefill_tokens:
            c["prefill_extrapolated"] = c.get("prefill_extrapolated", 0) + 1

    def _on_event(self, now: float, kind: int, obj, arrivals_left: bool) -> int:
        """Handle one event: _ABORT (stop the run), _IDLE (a periodic event with nothing
        left to do: it is not rescheduled) or _HANDLED."""
        cfg = self.cfg
        if kind == _STEP:
            return self._step_done(obj, now)
        if kind in (_KICK, _READY):
            self._kick(obj, now)
        elif not arrivals_left and all(w.idle() for w in self.workers.values()):
            return _IDLE  # nothing left: stop ticking
        elif kind == _TICK:
            self._tick(now)
            self._push(now + cfg.tick_s, _TICK, None)
        elif kind == _CLOCK:
            self._clock_tick(now)
            self._push(now + cfg.clock_period_s, _CLOCK, None)
        else:
            self._plan(now)
            self._push(now + cfg.planner_period_s, _PLAN, None)
        return _HANDLED

    def _step_done(self, w: SimWorker, now: float) -> int:
        """`w`'s iteration ended: completions, misses, clocks; start its next one."""
        st = w.step
        prefilled = st.new
        for r in w.end_step(now):
            self._finished(w, r, now, self._online)
            if w.rule is not None:
                cold = not w.rule.warm
                w.rule.observe(now - r.arrival, now)
                if cold:  # keys made under the cold W follow the first real one (SizeRule.key)
                    w.rekey_waiting()
                if w.rule.estimator is not None:
                    w.rule.estimator.observe(r.length_class, r.output_len, qo.client_of(r))
        self._count_misses(prefilled, now)
        if self.clock is not None:
            self._clock_step(w, st, now)
        if self.cfg.abort_misses and self.misses > self.cfg.abort_misses:
            self.counters["aborted"] = True
            return _ABORT
        self._kick(w, now)
        if w.draining and w.idle():
            self._stop(w, now)
        return _HANDLED

    def _tick(self, now: float) -> None:
        cfg = self.cfg
        if self.fitter is not None:
            self.policy_perf = self.fitter.current()
        if cfg.policy == "aladdin_rebalance" and any(w.waiting for w in self._live()):
            self._rebalance(now)
        if cfg.autoscale:
            self._release_idle(now)

    # ------------------------------------------------------------------ events and workers
    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, kind, self._seq, obj))

    def _wake(self, w: SimWorker, now: float) -> None:
        """Start idle `w` at `now`, after the arrivals at `now` (a _KICK event)."""
        self._push(now, _KICK, w)

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
        rule = self._new_rule()
        w = SimWorker(f"w{self._n_made:03d}", self.perf, self.cfg.worker, rule.key if rule else self.order_key,
                      started_at=now)
        w.rule = rule
        if self.cfg.worker.refine_preempt:
            if self.cfg.order not in ("ssjf", "sjf_oracle"):
                raise ValueError("refine_preempt needs order ssjf or sjf_oracle")
            w.refined_key = self._refiner(w)
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


def simulate(trace: Trace, perf: WorkerPerf, cfg: SimConfig, **kw) -> RunResult:
    """Run `cfg` over `trace` with true timings from `perf` (see `Cluster` for the options)."""
    return Cluster(trace, perf, cfg, **kw).run()


def with_worker(cfg: SimConfig, **worker_fields) -> SimConfig:
    """`cfg` with some WorkerConfig fields changed."""
    return replace(cfg, worker=replace(cfg.worker, **worker_fields))
