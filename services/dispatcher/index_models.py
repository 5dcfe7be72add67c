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
    these ~15 attribute reads and divisions; docs/benchmarks/dispatch.md, fourth round), and
    the config's knobs the limits read (one object to touch instead of two, fifth round).
    Each value is the same float expression the policy evaluates, so results are identical."""

    __slots__ = ("a0", "b_lim", "banked", "c1", "c2", "ctx_lim", "gamma", "h", "j", "k1", "k2", "perf",
                 "t_mag", "t_real0", "theta", "ttft_ok")

    def __init__(self, perf, cfg: AL.AladdinConfig):
        self.perf = perf  # (held: the cache is keyed by its id)
        self.theta, self.gamma = cfg.theta, cfg.gamma
        self.banked, self.ttft_ok = cfg.slack == "banked", cfg.ttft_slo_ms >= 0
        self.h: float
        self.j: float
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


class _Agg:
    """One worker under one config: one pass over its requests for what `capacity_norm`, the
    necessary and the sufficient ("surely passes") limits need, and what they read of its
    view (batch limit, KV capacity and use, the norm's denominators), so that a placement
    (`add`) updates them in place and recomputes the worker's key from this object and its
    model's `_Consts` alone. Before, a placement built a new `_Agg` and the key read the
    new `WorkerView` (~10 attribute reads on an object not in the CPU caches; fifth round)."""

    __slots__ = ("b0", "b_den", "c_den", "cap", "ctx", "cw", "k", "kv_used", "listed", "mb", "n", "prefilling",
                 "queued", "slack", "ub", "wctx")

    def __init__(self, w: WorkerView, cfg: AL.AladdinConfig, k: _Consts):
        h, j = k.h, k.j
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
        self.listed = self.n > 0  # a view listing no requests: batch and context from the heartbeat
        self.b0 = self.n if self.listed else max(w.outstanding, w.running + w.waiting)  # capacity_norm's b
        self.cw = wctx if self.listed else float(w.kv_used)  # its Σ(l_in + γ·l_out) (KV use when unlisted)
        self.k, self.mb, self.cap, self.kv_used = k, w.max_batch, w.kv_capacity, w.kv_used
        self.b_den = float(w.max_batch or 0) or k.b_lim or 1.0  # `_Consts.norm`'s denominators
        self.c_den = k.ctx_lim or float(w.kv_capacity or 1)

    def add(self, r) -> None:
        """A not-yet-started request `r` (an `as_new` entry) was appended to a worker that
        lists its requests: the same sums `__init__` gives the longer list (floats added in
        the same order)."""
        k = self.k
        n_in, out = r.input_tokens, r.predicted_tokens  # planned_output of a new entry: its prediction
        self.wctx = self.cw = self.wctx + (n_in + k.gamma * out)
        self.queued += n_in
        self.ctx += n_in
        self.n = self.b0 = self.n + 1
        kv = k.h * (n_in + out) + k.j
        self.ub = self.ub + (kv if kv > 0.0 else 0.0)  # (max(0.0, kv) without the call)

    def norm(self) -> float:
        """`policy_aladdin.capacity_norm` of the worker (`norm_of`'s float operations; with
        `_PLAIN_SUM` only: `cw` is `sum`'s left-to-right total)."""
        return math.hypot(self.b0 / self.b_den, float(self.cw) / self.c_den)


def _capacity_norm(w: WorkerView, cfg: AL.AladdinConfig, agg: _Agg) -> float:
    """`policy_aladdin.capacity_norm` from the aggregates (the same float operations)."""
    return agg.norm() if _PLAIN_SUM else AL.capacity_norm(w, cfg)


def _aladdin_limits(w: WorkerView, cfg: AL.AladdinConfig) -> tuple | None:
    """`_limits` of a worker computed from scratch (tests; the index keeps `_Agg`s)."""
    perf = AL._perf(w, cfg)
    return _limits(_Agg(w, cfg, _Consts(perf, cfg)))


def _limits(a: _Agg, head: tuple = ()) -> tuple | None:
    """Limits on a request for `check(w, request)`: three *necessary* ones (most input tokens
    by the TTFT, slack and first-step KV constraints, most input + γ·predicted by ATGT, most
    input + predicted by KV for a heartbeat-only view), each generous by `_tol` (one token
    for KV) so that float rounding never skips a feasible worker (inf = no limit), then
    three *sufficient* ones of the same form, as strict (−inf: only `check` can tell): a
    request within them passes every constraint. None when no request at all can pass
    (batch full, no TTFT / slack / ATGT / KV room). Reads `a` and its `_Consts` only (the
    view's fields it needs are in `a`); `_tol` and `l_d` are written out (a placement runs
    this: three calls fewer). `head`: what the tuple starts with (the key's (−cn, id): the
    key is built in one go)."""
    k = a.k
    h, j = k.h, k.j
    b = a.b0 + 1
    if a.mb and b > a.mb:
        return None
    max_in = room = max_total = _INF
    s_in = s_w = s_t = _INF
    queued, prefilling, slack = a.queued, a.prefilling, a.slack
    if k.perf is not None:
        # (b) ATGT: Σ(l_in + γ·l_out) + in + γ·pred <= θ·l_d(b)
        ld = k.a0 - k.c2 * b
        if k.k2 <= 0:
            ld = _INF if ld >= 0 else -1.0
        else:
            ld = ld / k.k2
        cap_w = k.theta * ld
        ctx_w = a.cw
        real = cap_w - ctx_w
        e = 1e-9 * (abs(real) + (abs(cap_w) + abs(ctx_w)) + 1.0) if real != _INF and real != -_INF else 0.0
        room, s_w = real + e, real - e
        if queued + prefilling > 0:  # (c) TTFT: prefill(queued + prefilling + in) <= T_pre
            if k.k1 > 0:
                real = k.t_real0 - (queued + prefilling)
                e = 1e-9 * (abs(real) + (k.t_mag + queued + prefilling) + 1.0) \
                    if real != _INF and real != -_INF else 0.0  # `_tol`, written out
                max_in = real + e
                s_in = real - e if k.ttft_ok else -_INF
            else:
                s_in = -_INF
        if k.banked:  # (d): prefill(queued + in) <= θ·slack (Alg. 1's banked slack)
            if slack < 0:
                return None  # a prefill takes >= 0 ms
            if slack < _INF:  # (with nothing queued an empty prompt takes 0 ms: never skip it)
                if k.k1 > 0:
                    real = (k.theta * slack - k.c1) / k.k1 - queued
                    e = 1e-9 * (abs(real) + ((abs(k.theta * slack) + abs(k.c1)) / k.k1 + queued) + 1.0) \
                        if real != _INF and real != -_INF else 0.0
                    bound = real + e
                    if not queued and not bound > 0.0:  # max(0.0, bound)
                        bound = 0.0
                    if bound < max_in:
                        max_in = bound
                    if real - e < s_in:
                        s_in = real - e
                else:
                    s_in = -_INF
        elif slack < _INF:
            s_in = -_INF  # "lifetime" slack: only `check` can tell
    cap = a.cap
    if cap > 0:  # (e) KV: the peak is at least the footprint of the first future step
        if a.listed:
            if h > 0:
                n = a.n + 1
                bound = (cap - j * n) / h - a.ctx - n + 1.0
                if bound < max_in:
                    max_in = bound
            # the peak is at most Σ of each request's footprint at its last step (h >= 0)
            free = cap - a.ub - (1.0 + 1e-9 * abs(cap))  # (`_margin` of a finite capacity)
            if h > 0 and free >= 0:
                s_t = (free - j) / h - 1.0
            elif h == 0 and free - max(0.0, j) >= 0:
                s_t = _INF
            else:
                s_t = -_INF
        elif k.perf is None:
            max_total = cap - a.kv_used + 1.0
            s_t = max_total - 1.0 - _margin(cap)
        elif h > 0:
            max_total = (cap - a.kv_used - j) / h + 1.0
            s_t = max_total - 1.0 - _margin(cap) / h
        else:
            s_t = -_INF
    if max_in < 0 or room < k.gamma or max_total < 1:
        return None  # every request has input >= 0, predicted >= 1 (as Aladdin plans it)
    return (*head, max_in, room, max_total, s_in, s_w, s_t)


class _Aladdin(_Struct):
    """Workers by (−capacity_norm, id) under one config, those some request may fit, with
    their `_limits`: keys (−cn, id, limits...); `norms` holds every worker's −cn (the
    fallback scans the views: no sorted order of all workers is kept)."""

    LAZY = True

    def __init__(self, cfg: AL.AladdinConfig):
        self.cfg = cfg
        self.norms: dict[str, float] = {}
        self.live = _Blocked()
        self.aggs: dict[str, _Agg] = {}
        self.consts: dict[int, _Consts] = {}  # id(perf) -> its constants under cfg

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if new is None:
            self.norms.pop(old.worker_id, None)  # type: ignore[union-attr]
            self.live.discard(old.worker_id)  # type: ignore[union-attr]
            self.aggs.pop(old.worker_id, None)  # type: ignore[union-attr]
            return
        wid, cfg = new.worker_id, self.cfg
        if added is not None and old is not None and self.placed_from(old, added):
            return  # a placement (`WorkerIndex.placed`), O(1)
        perf = new.perf if new.perf is not None else cfg.perf
        k = self.consts.get(id(perf))
        if k is None or k.perf is not perf:
            if len(self.consts) > 4096:  # per-worker online fits are replaced as they refit
                self.consts.clear()
            k = self.consts[id(perf)] = _Consts(perf, cfg)
        a = self.aggs[wid] = _Agg(new, cfg, k)
        self._key(wid, _capacity_norm(new, cfg, a), a)

    def can_place(self, wid: str) -> bool:
        """Whether a placement on `wid` updates its key from the entry alone (`placed_from`):
        its view lists its requests (else the batch and context come from the heartbeat)."""
        a = self.aggs.get(wid)
        return a is not None and a.listed and _PLAIN_SUM

    def placed_from(self, w: WorkerView, entry) -> bool:
        """A placement on the worker: its sums updated in place and its key recomputed from
        them, O(1), when it `can_place` (True); else False, nothing done."""
        wid = w.worker_id
        a = self.aggs.get(wid)
        if a is None or not a.listed or not _PLAIN_SUM:
            return False
        a.add(entry)
        self._key(wid, a.norm(), a)
        return True

    def _key(self, wid: str, norm: float, a: _Agg) -> None:
        cn = self.norms[wid] = -norm
        key = _limits(a, (cn, wid))
        if key is None:
            self.live.discard(wid)  # no request can fit it: never checked
        else:
            self.live.set(wid, key)
