"""The model-driven structures of `dispatcher.index`: Aladdin's limits and blocks (see the
index's docstring; CaraServe's cost groups are in `index_cara`).
"""
from __future__ import annotations

from polyserve.dispatcher import policy_aladdin as AL
from polyserve.dispatcher.index_structs import _INF, _Blocked, _Struct
from polyserve.dispatcher.views import RequestView, WorkerView

# ------------------------------------------------------------------ aladdin
_EMPTY_REQ = RequestView(input_tokens=0, predicted_tokens=0)
_PLAIN_SUM = sum([1e16, 1.0, -1e16]) == 0.0  # builtin sum adds floats left to right (CPython < 3.12)


def _margin(x: float) -> float:
    """Tokens of slack a sufficient condition keeps from a limit (float rounding of `check`)."""
    return 1.0 + 1e-9 * abs(x) if x != _INF and x != -_INF else 1.0


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


def _capacity_norm(w: WorkerView, cfg: AL.AladdinConfig, perf, agg: _Agg) -> float:
    """`policy_aladdin.capacity_norm` from the aggregates (the same float operations)."""
    if not _PLAIN_SUM:
        return AL.capacity_norm(w, cfg)
    b = agg.n if w.requests else max(w.outstanding, w.running + w.waiting)
    ctx = float(agg.wctx) if w.requests else float(w.kv_used)
    return AL.norm_of(w, cfg, perf, b, ctx)


def _aladdin_limits(w: WorkerView, cfg: AL.AladdinConfig, perf=None, agg: _Agg | None = None) -> tuple | None:
    """Limits on a request for `check(w, request)`: three *necessary* ones (most input tokens
    by the TTFT, slack and first-step KV constraints, most input + γ·predicted by ATGT, most
    input + predicted by KV for a heartbeat-only view), each one token generous so that float
    rounding never skips a feasible worker (inf = no limit), then three *sufficient* ones of
    the same form, a margin strict (−inf: only `check` can tell): a request within them
    passes every constraint. None when no request at all can pass (batch full, no TTFT /
    slack / ATGT / KV room)."""
    if perf is None:
        perf = AL._perf(w, cfg)
    h, j = (perf.base.h, perf.base.j) if perf is not None else (1.0, 0.0)
    if agg is None:
        agg = _Agg(w, cfg, h, j)
    b = (agg.n if w.requests else max(w.outstanding, w.running + w.waiting)) + 1
    if w.max_batch and b > w.max_batch:
        return None
    max_in = room = max_total = _INF
    s_in = s_w = s_t = _INF
    queued, prefilling, slack = agg.queued, agg.prefilling, agg.slack
    if perf is not None:
        m = perf.base
        # (b) ATGT: Σ(l_in + γ·l_out) + in + γ·pred <= θ·l_d(b)
        real = cfg.theta * perf.l_d(b, cfg.atgt_slo_ms) - (agg.wctx if w.requests else float(w.kv_used))
        room, s_w = real + 1.0, real - _margin(real)
        if queued + prefilling > 0:  # (c) TTFT: prefill(queued + prefilling + in) <= T_pre
            if m.k1 > 0:
                real = (cfg.ttft_slo_ms - m.c1) / m.k1 - (queued + prefilling)
                max_in = real + 1.0
                s_in = real - _margin(real) if cfg.ttft_slo_ms >= 0 else -_INF
            else:
                s_in = -_INF
        if cfg.slack == "banked":  # (d): prefill(queued + in) <= θ·slack (Alg. 1's banked slack)
            if slack < 0:
                return None  # a prefill takes >= 0 ms
            if slack < _INF:  # (with nothing queued an empty prompt takes 0 ms: never skip it)
                if m.k1 > 0:
                    real = (cfg.theta * slack - m.c1) / m.k1 - queued
                    bound = real + 1.0
                    max_in = min(max_in, bound if queued else max(0.0, bound))
                    s_in = min(s_in, real - _margin(real))
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

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if new is None:
            self.norms.pop(old.worker_id, None)
            self.live.discard(old.worker_id)
            self.aggs.pop(old.worker_id, None)
            return
        wid, cfg = new.worker_id, self.cfg
        perf = AL._perf(new, cfg)
        h, j = (perf.base.h, perf.base.j) if perf is not None else (1.0, 0.0)
        prev = self.aggs.get(wid) if added is not None and old is not None and old.requests else None
        agg = prev.plus(added, cfg, h, j) if prev is not None else _Agg(new, cfg, h, j)
        self.aggs[wid] = agg
        cn = -_capacity_norm(new, cfg, perf, agg)
        self.norms[wid] = cn
        limits = _aladdin_limits(new, cfg, perf, agg)
        if limits is None:
            self.live.discard(wid)  # no request can fit it: never checked
        else:
            self.live.set(wid, (cn, wid, *limits))
