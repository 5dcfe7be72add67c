"""The model-driven structures of `dispatcher.index`: Aladdin's limits and blocks (see the
index's docstring; CaraServe's cost groups are in `index_cara`).
"""
from __future__ import annotations

import math

from polyserve.dispatcher import policy_aladdin as AL
from polyserve.dispatcher.index_structs import _INF, _Blocked, _Struct
from polyserve.dispatcher.views import RequestView, WorkerView

# ------------------------------------------------------------------ aladdin
_EMPTY_REQ = RequestView(input_tokens=0, predicted_tokens=0)
_PLAIN_SUM = sum([1e16, 1.0, -1e16]) == 0.0  # builtin sum adds floats left to right (CPython < 3.12)


def _margin(x: float) -> float:
    """Tokens of slack a sufficient condition keeps from a limit (float rounding of `check`)."""
    return 1.0 + 1e-9 * abs(x) if x != _INF and x != -_INF else 1.0


def _tol(real: float, mag: float) -> float:
    """How far `check`'s float arithmetic may put a limit from `real` (tokens), where `mag`
    bounds the magnitude of the operands both sides add up: 1e-9 relative, 10^7 times the
    rounding error of the few additions involved. It used to be one whole token either way:
    with integer inputs that left two input lengths per limit where only `check` could
    tell, and as Alg. 1 packs workers, requests land there: ~1% of decisions ran `check`
    (40-80 µs with a cold cache), the whole p99 (docs/benchmarks/dispatch.md, fourth round)."""
    return 1e-9 * (abs(real) + mag + 1.0) if real != _INF and real != -_INF else 0.0


class _Consts:
    """What `capacity_norm` and `_aladdin_limits` read of a perf model under one config,
    computed once per model instead of on every update (a placement's update used to redo
    these ~15 attribute reads and divisions; docs/benchmarks/dispatch.md, fourth round).
    Each value is the same float expression the policy evaluates, so results are identical."""

    __slots__ = ("a0", "b_lim", "c1", "c2", "ctx_lim", "h", "j", "k1", "k2", "perf", "t_mag", "t_real0")

    def __init__(self, perf, cfg: AL.AladdinConfig):
        self.perf = perf  # (held: the cache is keyed by its id)
        self.h, self.j = (perf.base.h, perf.base.j) if perf is not None else (1.0, 0.0)
        self.b_lim = self.ctx_lim = 0.0
        if perf is None:
            return
        m = perf.base
        self.k1, self.c1, self.k2, self.c2 = m.k1, m.c1, m.k2, m.c2
        self.a0 = cfg.atgt_slo_ms - m.c3  # WorkerPerf.l_d: (T_dec - c3) - c2·b, / k2
        if m.c2 > 0:  # norm_of's batch limit when the worker reports no max_batch
            self.b_lim = max(1.0, (cfg.atgt_slo_ms - m.c3) / m.c2)
        ld1 = self.l_d(1)
        self.ctx_lim = ld1 if ld1 and math.isfinite(ld1) and ld1 > 0 else 0.0  # 0: kv_capacity
        if m.k1 > 0:
            self.t_real0 = (cfg.ttft_slo_ms - m.c1) / m.k1
            self.t_mag = (abs(cfg.ttft_slo_ms) + abs(m.c1)) / m.k1

    def l_d(self, b: int) -> float:
        """`WorkerPerf.l_d(b, cfg.atgt_slo_ms)`, the same float operations."""
        room = self.a0 - self.c2 * b
        if self.k2 <= 0:
            return math.inf if room >= 0 else -1.0
        return room / self.k2

    def norm(self, w: WorkerView, b: int, ctx: float) -> float:
        """`policy_aladdin.norm_of(w, cfg, perf, b, ctx)`."""
        return math.hypot(b / (float(w.max_batch or 0) or self.b_lim or 1.0),
                          ctx / (self.ctx_lim or float(w.kv_capacity or 1)))


class _Agg:
    """One pass over a worker's requests: what `capacity_norm`, the necessary limits and the
    sufficient ("surely passes") limits need; kept incrementally when a request is placed."""

    __slots__ = ("ctx", "n", "prefilling", "queued", "slack", "ub", "wctx")

    def __init__(self, w: WorkerView, cfg: AL.AladdinConfig, h: float, j: float):
        wctx, queued, prefilling, ctx, slack, ub = 0.0, 0, 0, 0, _INF, 0.0
        g, t_dec, planned = cfg.gamma, cfg.atgt_slo_ms, AL.planned_output
        for r in w.requests:
            out = planned(r, cfg)
            wctx += r.input_tokens + g * out  # in request order, as `sum` in capacity_norm
            c = r.input_tokens + r.generated
            ctx += c
            left = out - r.generated
            ub += max(0.0, h * (c + max(1, left)) + j)  # its KV at its last step
            if not r.started:
                queued += r.input_tokens
            else:
                if r.generated == 0:
                    prefilling += r.input_tokens
                slack = min(slack, t_dec * max(1, r.generated) - r.decode_ms)
        self.wctx, self.queued, self.prefilling, self.ctx, self.slack, self.ub = wctx, queued, prefilling, ctx, slack, ub
        self.n = len(w.requests)

    def plus(self, r, cfg: AL.AladdinConfig, h: float, j: float) -> _Agg:
        """The aggregates with a not-yet-started request `r` (an `as_new` entry) appended."""
        a = object.__new__(_Agg)
        out = r.predicted_tokens  # planned_output of a new entry: its prediction (>= 1)
        a.wctx = self.wctx + (r.input_tokens + cfg.gamma * out)
        a.queued, a.prefilling = self.queued + r.input_tokens, self.prefilling
        a.ctx, a.slack, a.n = self.ctx + r.input_tokens, self.slack, self.n + 1
        a.ub = self.ub + max(0.0, h * (r.input_tokens + out) + j)
        return a


def _capacity_norm(w: WorkerView, cfg: AL.AladdinConfig, perf, agg: _Agg, k: _Consts | None = None) -> float:
    """`policy_aladdin.capacity_norm` from the aggregates (the same float operations)."""
    if not _PLAIN_SUM:
        return AL.capacity_norm(w, cfg)
    b = agg.n if w.requests else max(w.outstanding, w.running + w.waiting)
    ctx = float(agg.wctx) if w.requests else float(w.kv_used)
    if k is None:
        return AL.norm_of(w, cfg, perf, b, ctx)
    return k.norm(w, b, ctx)


def _aladdin_limits(w: WorkerView, cfg: AL.AladdinConfig, perf=None, agg: _Agg | None = None,
                    k: _Consts | None = None) -> tuple | None:
    """Limits on a request for `check(w, request)`: three *necessary* ones (most input tokens
    by the TTFT, slack and first-step KV constraints, most input + γ·predicted by ATGT, most
    input + predicted by KV for a heartbeat-only view), each generous by `_tol` (one token
    for KV) so that float rounding never skips a feasible worker (inf = no limit), then
    three *sufficient* ones of the same form, as strict (−inf: only `check` can tell): a
    request within them
    passes every constraint. None when no request at all can pass (batch full, no TTFT /
    slack / ATGT / KV room)."""
    if perf is None:
        perf = AL._perf(w, cfg)
    if k is None:
        k = _Consts(perf, cfg)
    h, j = k.h, k.j
    if agg is None:
        agg = _Agg(w, cfg, h, j)
    b = (agg.n if w.requests else max(w.outstanding, w.running + w.waiting)) + 1
    if w.max_batch and b > w.max_batch:
        return None
    max_in = room = max_total = _INF
    s_in = s_w = s_t = _INF
    queued, prefilling, slack = agg.queued, agg.prefilling, agg.slack
    if perf is not None:
        # (b) ATGT: Σ(l_in + γ·l_out) + in + γ·pred <= θ·l_d(b)
        cap_w = cfg.theta * k.l_d(b)
        ctx_w = agg.wctx if w.requests else float(w.kv_used)
        real = cap_w - ctx_w
        e = _tol(real, abs(cap_w) + abs(ctx_w))
        room, s_w = real + e, real - e
        if queued + prefilling > 0:  # (c) TTFT: prefill(queued + prefilling + in) <= T_pre
            if k.k1 > 0:
                real = k.t_real0 - (queued + prefilling)
                e = _tol(real, k.t_mag + queued + prefilling)
                max_in = real + e
                s_in = real - e if cfg.ttft_slo_ms >= 0 else -_INF
            else:
                s_in = -_INF
        if cfg.slack == "banked":  # (d): prefill(queued + in) <= θ·slack (Alg. 1's banked slack)
            if slack < 0:
                return None  # a prefill takes >= 0 ms
            if slack < _INF:  # (with nothing queued an empty prompt takes 0 ms: never skip it)
                if k.k1 > 0:
                    real = (cfg.theta * slack - k.c1) / k.k1 - queued
                    e = _tol(real, (abs(cfg.theta * slack) + abs(k.c1)) / k.k1 + queued)
                    bound = real + e
                    max_in = min(max_in, bound if queued else max(0.0, bound))
                    s_in = min(s_in, real - e)
                else:
                    s_in = -_INF
        elif slack < _INF:
            s_in = -_INF  # "lifetime" slack: only `check` can tell
    if w.kv_capacity > 0:  # (e) KV: the peak is at least the footprint of the first future step
        cap = w.kv_capacity
        if w.requests:
            if h > 0:
                n = agg.n + 1
                max_in = min(max_in, (cap - j * n) / h - agg.ctx - n + 1.0)
            # the peak is at most Σ of each request's footprint at its last step (h >= 0)
            free = cap - agg.ub - _margin(cap)
            if h > 0 and free >= 0:
                s_t = (free - j) / h - 1.0
            elif h == 0 and free - max(0.0, j) >= 0:
                s_t = _INF
            else:
                s_t = -_INF
        elif perf is None:
            max_total = cap - w.kv_used + 1.0
            s_t = max_total - 1.0 - _margin(cap)
        elif h > 0:
            max_total = (cap - w.kv_used - j) / h + 1.0
            s_t = max_total - 1.0 - _margin(cap) / h
        else:
            s_t = -_INF
    if max_in < 0 or room < cfg.gamma or max_total < 1:
        return None  # every request has input >= 0, predicted >= 1 (as Aladdin plans it)
    return max_in, room, max_total, s_in, s_w, s_t


class _Aladdin(_Struct):
    """Workers by (−capacity_norm, id) under one config, those some request may fit, with
    their `_aladdin_limits`: keys (−cn, id, limits...); `norms` holds every worker's −cn (the
    fallback scans the views: no sorted order of all workers is kept)."""

    def __init__(self, cfg: AL.AladdinConfig):
        self.cfg = cfg
        self.norms: dict[str, float] = {}
        self.live = _Blocked()
        self.aggs: dict[str, _Agg] = {}
        self.consts: dict[int, _Consts] = {}  # id(perf) -> its constants under cfg

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if new is None:
            self.norms.pop(old.worker_id, None)
            self.live.discard(old.worker_id)
            self.aggs.pop(old.worker_id, None)
            return
        wid, cfg = new.worker_id, self.cfg
        perf = new.perf if new.perf is not None else cfg.perf
        k = self.consts.get(id(perf))
        if k is None or k.perf is not perf:
            if len(self.consts) > 4096:  # per-worker online fits are replaced as they refit
                self.consts.clear()
            k = self.consts[id(perf)] = _Consts(perf, cfg)
        prev = self.aggs.get(wid) if added is not None and old is not None and old.requests else None
        agg = prev.plus(added, cfg, k.h, k.j) if prev is not None else _Agg(new, cfg, k.h, k.j)
        self.aggs[wid] = agg
        cn = -_capacity_norm(new, cfg, perf, agg, k)
        self.norms[wid] = cn
        limits = _aladdin_limits(new, cfg, perf, agg, k)
        if limits is None:
            self.live.discard(wid)  # no request can fit it: never checked
        else:
            self.live.set(wid, (cn, wid, *limits))
