"""The discrete-event cluster: arrivals from a trace, placement by the dispatcher's own
policies (`polyserve.dispatcher.policy.POLICIES`, Aladdin's `place`/`rebalance`), queue
order by the worker's own order keys (`polyserve.worker.policy.ORDER_KEYS`), workers
from `engine.SimWorker`, events on a heap.

Placement names: every name in `POLICIES`, plus ``aladdin_rebalance`` (Aladdin Alg. 1
with Alg. 2 re-balancing every `rebalance_s`). With `autoscale`, Aladdin's scale-out
signal (no worker passes Alg. 1) opens a worker (ready after `cold_start_s`), and a
worker idle for `idle_release_s` is released, down to `workers`; other policies never
signal, so they keep `workers` fixed.
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from polyserve.dispatcher import policy_aladdin as aladdin
from polyserve.dispatcher.perf_models import PerfFitter, WorkerPerf
from polyserve.dispatcher.policy import POLICIES, PolicyState, RequestView, RunningRequest, WorkerView
from polyserve.simulator.engine import SimRequest, SimWorker, WorkerConfig
from polyserve.simulator.predictor import ConditionalMean, LengthPredictor
from polyserve.simulator.trace import Adapters, Trace
from polyserve.worker.policy import ORDER_KEYS, ssjf_key

SIM_POLICIES = (*POLICIES, "aladdin_rebalance")
NEEDS_REQUESTS = {"aladdin", "aladdin_rebalance", "caraserve"}
# Event kinds, in their order at equal times. Arrivals at time t are handled before any
# event at t, and an idle worker is started by a _KICK at t, so requests arriving together
# (or exactly at a step boundary) join the same step.
_STEP, _KICK, _READY, _TICK = 0, 1, 2, 3


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

    def validate(self) -> None:
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; choose one of {', '.join(SIM_POLICIES)}")
        if self.order not in ORDER_KEYS:
            raise ValueError(f"order {self.order!r} is unknown; choose one of {', '.join(ORDER_KEYS)}")
        if self.workers < 1 or self.max_workers < self.workers:
            raise ValueError("need 1 <= workers <= max_workers")
        if self.worker.kv_mode not in ("grow", "reserve"):
            raise ValueError("kv_mode must be 'grow' or 'reserve'")


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

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        t_wall = time.perf_counter()
        tr, cfg = self.trace, self.cfg
        for _ in range(cfg.workers):
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
        last = 0.0
        while i < n or self.events:
            if self.events and (i >= n or self.events[0][0] < arrivals[i]):
                now, kind, _, obj = heapq.heappop(self.events)
                if kind == _STEP:
                    prefilled = obj.step.new
                    for r in obj.end_step(now):
                        self._finished(obj, r, now, online)
                    self._count_misses(prefilled, now)
                    if cfg.abort_misses and self.misses > cfg.abort_misses:
                        self.counters["aborted"] = True
                        break
                    self._kick(obj, now)
                elif kind in (_KICK, _READY):
                    self._kick(obj, now)
                else:
                    if i >= n and all(w.idle() for w in self.workers.values()):
                        continue  # nothing left: stop ticking
                    self._tick(now)
                    self._push(now + cfg.tick_s, _TICK, None)
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
        return RunResult(conf, reqs, horizon, gpu_s, peak, self.timeline, self.counters,
                         time.perf_counter() - t_wall, self.fitter.errors() if self.fitter else None)

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, kind, self._seq, obj))

    def _kick(self, w: SimWorker, now: float) -> None:
        if w.step is None and now >= w.ready_at:
            end = w.start_step(now)
            if end is not None:
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
        return [w for w in self.workers.values() if w.stopped_at is None]

    def _arrive(self, r: SimRequest, now: float) -> None:
        cfg = self.cfg
        if cfg.max_input_len and r.input_len > cfg.max_input_len:
            r.rejected = f"input longer than max_input_len={cfg.max_input_len}"
            self.counters["rejected"] += 1
            self.misses += 1
            return
        w = self._choose(r, now)
        if not w.enqueue(r, now):
            self.counters["rejected"] += 1
            self.misses += 1
            return
        if w.step is None:
            self._push(now, _KICK, w)

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
            if cfg.autoscale and len(live) < cfg.max_workers:
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
