"""Where the simulated cluster puts each request: the dispatcher's own policies over views
of the simulated workers, Aladdin's Alg. 1 (with its scale-out signal under `autoscale`)
and Alg. 2 re-balancing. A mixin of `cluster.Cluster`, which holds the state it reads
(`cfg`, `workers`, `state`, `rng`, `acfg`, `ledger`, `policy_perf`, `counters`) and the
event helpers it calls (`_live`, `_open`, `_wake`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from polyserve.dispatcher import policy_aladdin as aladdin
from polyserve.dispatcher.policy import POLICIES, RequestView, RunningRequest, WorkerView
from polyserve.simulator.config import NEEDS_REQUESTS
from polyserve.simulator.engine import SimRequest, SimWorker

if TYPE_CHECKING:
    import random

    from polyserve.core.perf import WorkerPerf
    from polyserve.dispatcher.policy import PolicyState
    from polyserve.simulator.config import SimConfig


class Placement:
    """Routing of arrivals and re-queued requests; worker views for the policies."""

    cfg: SimConfig
    workers: dict[str, SimWorker]
    state: PolicyState
    rng: random.Random
    acfg: aladdin.AladdinConfig
    ledger: aladdin.ErrorLedger
    policy_perf: WorkerPerf
    counters: dict
    misses: int

    def _arrive(self, r: SimRequest, now: float) -> None:
        cfg = self.cfg
        if cfg.max_input_len and r.input_len > cfg.max_input_len:
            r.rejected = f"input longer than max_input_len={cfg.max_input_len}"
            self.counters["rejected"] += 1
            self.misses += 1
            return
        self._route(r, now)

    def _route(self, r: SimRequest, now: float) -> None:
        """Place a request on the worker the policy chooses (and start it if it is idle)."""
        w = self._choose(r, now)
        if not w.enqueue(r, now):
            self.counters["rejected"] += 1
            self.misses += 1
            return
        if w.step is None:
            self._wake(w, now)

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
            return self._choose_aladdin(rv, views, live, now, detail)
        d = POLICIES[cfg.policy](views, rv, self.state, self.rng)
        self.state = d.state
        return self.workers[d.worker_id]

    def _choose_aladdin(self, rv: RequestView, views: list[WorkerView], live: list[SimWorker], now: float,
                        detail: bool) -> SimWorker:
        """Alg. 1 over the ready workers; when none fits, with `autoscale`, a cold-starting
        worker or a new one; else the policy's own fallback (the emptiest worker)."""
        cfg = self.cfg
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
        return self.workers[POLICIES["aladdin"](views, rv, self.state, self.rng).worker_id]

    def _view(self, w: SimWorker, now: float, detail: bool) -> WorkerView:
        reqs = _requests_of(w, now) if detail else ()
        l_e, b_e = self.ledger.errors(w.id, now) if self.cfg.policy == "aladdin_rebalance" else (0.0, 0.0)
        names = tuple(w.adapters)
        wc = self.cfg.worker
        return WorkerView(worker_id=w.id, outstanding=w.in_flight(), running=w.b, waiting=len(w.waiting),
                          kv_used=w.kv_used(), kv_capacity=wc.kv_capacity, adapters=names,
                          adapter_ranks=tuple(w.adapters[a] for a in names), max_adapters=wc.max_adapters,
                          kernel=wc.kernel, max_batch=wc.max_batch, requests=reqs, perf=self.policy_perf,
                          len_error=l_e, batch_error=b_e)

    def _rebalance(self, now: float) -> None:
        """Aladdin Alg. 2: move queued requests between ready workers."""
        live = [w for w in self._live() if w.ready_at <= now]
        views = [self._view(w, now, True) for w in live]
        for mv in aladdin.rebalance(views, self.acfg):
            src, dst = self.workers[mv.src], self.workers[mv.dst]
            r = src.remove_waiting(mv.request_id)
            if r is not None and dst.enqueue(r, now):
                self.counters["moves"] += 1
                if dst.step is None:
                    self._wake(dst, now)


def _requests_of(w: SimWorker, now: float) -> tuple[RunningRequest, ...]:
    """Every request on `w` as the dispatcher's book holds it: running, being prefilled, queued."""
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
    return tuple(out)
