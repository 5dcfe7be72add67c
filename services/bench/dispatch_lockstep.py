"""The timed loops of `polyserve bench dispatch` for one policy: the burst and the steady
state (see `bench.dispatch`), the indexed and the pure side in lockstep. `ix` is the index
module under test (`polyserve.dispatcher.index`, or the copy `--baseline-index` loads).
"""
from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from polyserve.dispatcher.policy import PolicyState, WorkerView

if TYPE_CHECKING:
    from polyserve.bench.dispatch import Workload


@dataclass
class Lockstep:
    """One policy's run: the indexed (fast) and the pure side on the same cluster, request
    stream and rng; the (worker, request) pairs outstanding."""

    name: str
    wl: Workload  # bench.dispatch.Workload: views, requests, heartbeats
    base: list[WorkerView]
    track: bool
    fast: Any  # the index module's WorkerIndex (current or --baseline-index)
    pure: Any
    frng: random.Random
    prng: random.Random
    fstate: PolicyState
    pstate: PolicyState
    outstanding: list[tuple[str, str]] = field(default_factory=list)


def burst(run: Lockstep, args: argparse.Namespace, ix: ModuleType) -> dict:
    """1. `--outstanding` requests placed back to back on the idle cluster, each followed by
    its index update; the pure side too with `--pure-burst`, else it starts from the index's
    state. Leaves `run.outstanding` filled."""
    fast_fn, pure_fn = ix.FAST_POLICIES[run.name], ix.PURE_POLICIES[run.name]
    fast, pure, frng, prng, fstate, pstate = run.fast, run.pure, run.frng, run.prng, run.fstate, run.pstate
    outstanding = run.outstanding
    reqs = [run.wl.request() for _ in range(args.outstanding)]
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for r in reqs:
        d = fast_fn(fast, r, fstate, frng)
        fstate = d.state
        fast.placed(d.worker_id, r)
    burst_fast_cpu_ms = (time.thread_time_ns() - c0) / 1e6
    burst_fast_ms = (time.perf_counter_ns() - t0) / 1e6
    burst_pure_ms = burst_pure_cpu_ms = None
    if args.pure_burst:
        pl = pure._order  # the dispatcher's list of views (kept current by the index)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for r in reqs:
            d = pure_fn(pl, r, pstate, prng)
            pstate = d.state
            pure.placed(d.worker_id, r)
            outstanding.append((d.worker_id, r.request_id))
        burst_pure_cpu_ms = (time.thread_time_ns() - c0) / 1e6
        burst_pure_ms = (time.perf_counter_ns() - t0) / 1e6
    else:  # the pure side starts from the index's state
        pure = ix.WorkerIndex(track_requests=run.track)
        for v in fast.views():
            pure.upsert(v)
        prng.setstate(frng.getstate())
        pstate = fstate
    bursts_equal = sorted(v.worker_id + str(v.outstanding) for v in fast.views()) == \
        sorted(v.worker_id + str(v.outstanding) for v in pure.views())
    if not outstanding:  # rebuild the outstanding list from the views (pure burst skipped)
        for w in fast.views():
            outstanding += [(w.worker_id, r.request_id) for r in w.requests] if run.track else \
                [(w.worker_id, "")] * w.outstanding
    run.pure, run.fstate, run.pstate = pure, fstate, pstate
    return {"burst_fast_ms": burst_fast_ms, "burst_pure_ms": burst_pure_ms, "burst_fast_cpu_ms": burst_fast_cpu_ms,
            "burst_pure_cpu_ms": burst_pure_cpu_ms, "burst_same_placements": bursts_equal}


def steady(run: Lockstep, args: argparse.Namespace, ix: ModuleType) -> dict:
    """2. Steady state: per step one heartbeat, one completion and one decision (+ its
    update); the pure side in lockstep for the first `--pure-decisions` steps, compared."""
    fast_fn, pure_fn = ix.FAST_POLICIES[run.name], ix.PURE_POLICIES[run.name]
    wl, base, fast, pure, outstanding = run.wl, run.base, run.fast, run.pure, run.outstanding
    frng, prng, fstate, pstate = run.frng, run.prng, run.fstate, run.pstate
    fast_us, pure_us, hb_us, fin_us, fast_cpu, pure_cpu, dec_cpu, upd_cpu = [], [], [], [], [], [], [], []
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    same = compared = 0
    gc.collect()
    for i in range(args.decisions):
        lock = i < args.pure_decisions
        wid = wl.rng.choice(base).worker_id
        hb = wl.heartbeat(fast.get(wid))
        t0 = time.perf_counter_ns()
        fast.upsert(hb)
        hb_us.append((time.perf_counter_ns() - t0) / 1e3)
        if lock:
            pure.upsert(hb)
        if outstanding:
            k = wl.rng.randrange(len(outstanding))
            outstanding[k], outstanding[-1] = outstanding[-1], outstanding[k]
            owid, rid = outstanding.pop()
            t0 = time.perf_counter_ns()
            fast.finished(owid, rid)
            fin_us.append((time.perf_counter_ns() - t0) / 1e3)
            if lock:
                pure.finished(owid, rid)
        r = wl.request()
        # the index first: after the scan (1-3 ms over every view) it would find the CPU
        # caches full of the scan's data, which a dispatcher running the index never has
        t0, c0 = pc(), tt()
        d = fast_fn(fast, r, fstate, frng)
        cm = tt()  # (one more clock read, ~0.3 µs, counted in the total: the split below)
        fast.placed(d.worker_id, r)
        c1, t1 = tt(), pc()
        fast_us.append((t1 - t0) / 1e3)
        fast_cpu.append((c1 - c0) / 1e3)
        dec_cpu.append((cm - c0) / 1e3)
        upd_cpu.append((c1 - cm) / 1e3)
        fstate = d.state
        if lock:
            t0, c0 = pc(), tt()
            pd = pure_fn(pure._order, r, pstate, prng)
            pure.placed(pd.worker_id, r)
            c1, t1 = tt(), pc()
            pure_us.append((t1 - t0) / 1e3)
            pure_cpu.append((c1 - c0) / 1e3)
            pstate = pd.state
        outstanding.append((d.worker_id, r.request_id))
        if lock:
            compared += 1
            same += pd == d
    run.fstate, run.pstate = fstate, pstate
    return {"fast_us": fast_us, "pure_us": pure_us, "hb_us": hb_us, "fin_us": fin_us, "fast_cpu": fast_cpu,
            "pure_cpu": pure_cpu, "decision_cpu": dec_cpu, "update_cpu": upd_cpu, "same": same, "compared": compared}
