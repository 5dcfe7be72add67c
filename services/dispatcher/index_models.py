"""The model-driven structures of `dispatcher.index`: Aladdin's limits and blocks, CaraServe's
cost groups (split from index.py; see its docstring for Aladdin's).

* caraserve: workers grouped by what `cost_of` reads besides their context (k2, c2, c3,
  the kernel's LoRA coefficients — by value —, kernel, batch b, max rank, Σ rank under
  MBGMV); within a group the cost grows with the mean context, so members sorted by
  (context, id) make the first one with KV room the group's cheapest. Each group keeps its
  members, its slot-free members and per adapter its holders, each sorted, and the groups
  are visited in the order of a lower bound of their cost (their first member's cost for
  an empty, rank-0 request) until the bound exceeds the best cost found; a group whose
  bound plus what the request's rank and input add to every member's cost (exact: the cost
  is separable) exceeds the best is skipped without evaluating it. A request for adapter A
  looks at the slot-free members and A's holders only (so the resident-first tie-break is
  exact). Needs k2 >= 0 and LoRA α >= 0 (otherwise that group is always scanned, still
  exact). With no candidate at all (no KV room or adapter slot anywhere) every worker
  competes, as in the pure policy. Exactness rests on float costs being ordered like the
  real-valued ones within a group (cost differences of >= k2·1 token, far above rounding)
  and on the skip margin (1e-9 relative). Costs: an update moves the worker within one or
  two groups (2 + its resident adapters sorted-list operations); a decision evaluates one
  worker per group visited. When every worker has its own, different fit (per-worker
  online fits) groups are single workers and more of them are visited (see
  `polyserve bench dispatch --perf-spread`).
"""
from __future__ import annotations

from bisect import bisect_left, insort

from polyserve.core.perf import BGMV, LORA_DEFAULTS, MBGMV
from polyserve.dispatcher import policy_aladdin as AL
from polyserve.dispatcher import policy_caraserve as CS
from polyserve.dispatcher.index_structs import _INF, _Blocked, _Sorted, _Struct
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
    """Workers by (−capacity_norm, id) under one config: all of them (for the fallback) and
    those some request may fit, with their `_aladdin_limits`: keys (−cn, id[, limits...])."""

    def __init__(self, cfg: AL.AladdinConfig):
        self.cfg = cfg
        self.all = _Sorted()
        self.live = _Blocked()
        self.aggs: dict[str, _Agg] = {}

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if new is None:
            self.all.discard(old.worker_id)
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
        self.all.set(wid, (cn, wid))
        limits = _aladdin_limits(new, cfg, perf, agg)
        if limits is None:
            self.live.discard(wid)  # no request can fit it: never checked
        else:
            self.live.set(wid, (cn, wid, *limits))


# ------------------------------------------------------------------ caraserve
_REQ0 = RequestView(input_tokens=0, adapter_rank=0)
_NO_PENALTY = CS.CaraConfig(penalty=0.0)


class _CaraGroup:
    """Workers alike in all `cost_of` reads but their context: all members, the slot-free
    ones, and per resident adapter its holders, each a list of (context, id) keys, sorted."""

    __slots__ = ("b", "bound", "bounded", "empty_costs", "free", "gid", "holders", "k2", "kernel", "lora_extra", "members",
                 "mx", "ordered", "perf", "sig", "sm")

    def __init__(self, gid: int, ordered: bool, bounded: bool):
        self.gid = gid
        self.members: list[tuple] = []
        self.free: list[tuple] = []
        self.holders: dict[str, list[tuple]] = {}
        self.ordered = ordered  # first member with KV room is the group's cheapest
        self.bounded = bounded  # the first member's cost for an empty request bounds the group
        self.bound = -_INF
        self.lora_extra: dict[int, float] = {}  # rank -> what it adds to every member's cost
        self.empty_costs: dict[float, float] = {}  # context -> the cost of an empty request

    def extra(self, rank: int) -> float:
        """(b+1)·(LoRA share of the step with a rank-`rank` request − with a rank-0 one): what
        a request's rank adds to the cost of every member, exactly (cost_of is separable)."""
        d = self.lora_extra.get(rank)
        if d is None:
            lora, k, b1 = self.perf.lora_ms, self.kernel, self.b + 1
            d = self.lora_extra[rank] = b1 * (lora(k, b1, max(self.mx, rank), self.sm + rank)
                                              - lora(k, b1, self.mx, self.sm))
        return d


def _cara_signature(w: WorkerView) -> tuple[tuple, tuple, bool, bool, tuple]:
    """(group signature, member key, ordered, bounded, cost inputs) of a worker (see the
    module docstring); the cost inputs are what `cost_of` computes before it looks at the
    request: (perf, kernel, b, mean context, max rank, Σ rank, step time now)."""
    perf = w.perf or CS._LORA_ONLY
    b, ctx, mx, sm = CS._batch_state(w)
    state = (perf, w.kernel, b, ctx, mx, sm, CS.step_ms(perf, w.kernel, b, ctx, mx, sm))
    m = perf.base
    lora = tuple(perf.lora.get(w.kernel, LORA_DEFAULTS[BGMV]))
    alpha = lora[0]
    bounded = m.k2 >= 0 and alpha >= 0
    if m.k2 > 0 and m.c2 >= 0 and m.c3 >= 0:
        ordered, mkey = True, (ctx, w.worker_id)
    elif m.k2 == 0:
        ordered, mkey = True, (0.0, w.worker_id)  # the context does not enter the cost
    else:
        ordered, mkey = False, (ctx, w.worker_id)
    # what `cost_of` reads of the perf model, by value: workers with equal fits share groups
    sig = (m.k2, m.c2, m.c3, lora, w.kernel, b, mx, sm if w.kernel == MBGMV else -1)
    return sig, mkey, ordered, bounded, state


def _cara_cost(state: tuple, n_in: int, rank: int, slo: float, penalty: float) -> tuple[float, bool]:
    """(cost, violates) of `policy_caraserve.cost_of` from a worker's cost inputs: the same
    calls and float operations, without recomputing what does not depend on the request."""
    perf, kernel, b, ctx, mx, sm, t0 = state
    ctx1 = (ctx * b + n_in) / (b + 1)
    t1 = CS.step_ms(perf, kernel, b + 1, ctx1, max(mx, rank), sm + rank)
    violates = t1 > slo
    return (b + 1) * t1 - b * t0 + (penalty if violates else 0.0), violates


def _slots_full(w: WorkerView) -> bool:
    return bool(w.max_adapters) and len(w.adapters) >= w.max_adapters


class _Cara(_Struct):
    """CaraServe's cost groups in one order of their lower bounds; a worker sits in one group
    (in its member list, its slot-free list when it has a free adapter slot, and the holder
    list of each adapter it holds), so an update touches one or two groups only."""

    def __init__(self, views: dict[str, WorkerView]):
        self.views = views
        self.groups: dict[tuple, _CaraGroup] = {}
        self.by_gid: dict[int, _CaraGroup] = {}
        self.bounds: list[tuple[float, int]] = []  # (bound, gid), sorted
        self.where: dict[str, tuple] = {}  # worker_id -> (group, member key, slot-free, adapters)
        self.state: dict[str, tuple] = {}  # worker_id -> its cost inputs (`_cara_signature`)
        self._next = 0

    def _rebound(self, g: _CaraGroup) -> None:
        bounds = self.bounds
        if g.members:
            bound = -_INF
            if g.bounded and g.ordered:  # the cost depends on the group and the context only
                ctx = g.members[0][0]
                bound = g.empty_costs.get(ctx)
                if bound is None:
                    if len(g.empty_costs) > 64:
                        g.empty_costs.clear()
                    bound = g.empty_costs[ctx] = _cara_cost(self.state[g.members[0][-1]], 0, 0, 0.0, 0.0)[0]
            if bound == g.bound:
                return
        else:
            bound = None
        del bounds[bisect_left(bounds, (g.bound, g.gid))]
        if bound is None:
            del self.groups[g.sig], self.by_gid[g.gid]
            return
        g.bound = bound
        insort(bounds, (bound, g.gid))

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if old is not None:
            g, mkey, free, adapters = self.where.pop(old.worker_id)
            first = g.members[0]
            m = g.members
            del m[bisect_left(m, mkey)]
            if free:
                del g.free[bisect_left(g.free, mkey)]
            for a in adapters:
                lst = g.holders[a]
                del lst[bisect_left(lst, mkey)]
                if not lst:
                    del g.holders[a]
            if not m or m[0] != first:
                self._rebound(g)
        if new is None:
            self.state.pop(old.worker_id, None)
            return
        sig, mkey, ordered, bounded, self.state[new.worker_id] = _cara_signature(new)
        g = self.groups.get(sig)
        if g is None:
            g = self.groups[sig] = _CaraGroup(self._next, ordered, bounded)
            g.sig = sig
            g.perf, g.kernel = new.perf or CS._LORA_ONLY, new.kernel
            g.b, _, g.mx, g.sm = CS._batch_state(new)
            m = g.perf.base  # the cost grows by (b+1)·k2 per input token (when it is ordered)
            g.k2 = (g.b + 1) * m.k2 if ordered and m.k2 > 0 and m.c2 >= 0 and m.c3 >= 0 else 0.0
            self.by_gid[g.gid] = g
            self._next += 1
            insort(self.bounds, (g.bound, g.gid))
        first = g.members[0] if g.members else None
        insort(g.members, mkey)
        free = not _slots_full(new)
        if free:
            insort(g.free, mkey)
        for a in new.adapters:
            lst = g.holders.get(a)
            if lst is None:
                g.holders[a] = [mkey]
            else:
                insort(lst, mkey)
        self.where[new.worker_id] = (g, mkey, free, new.adapters)
        if g.members[0] is not first:
            self._rebound(g)

    def best(self, req: RequestView, cfg: CS.CaraConfig, need: int, candidates_only: bool) -> tuple | None:
        """(cost, not resident, worker_id, violates) of the cheapest candidate (with
        `candidates_only` False: of every worker, as when there is no candidate)."""
        views, by_gid, states = self.views, self.by_gid, self.state
        adapter, rank, n_in = req.adapter, req.adapter_rank, req.input_tokens
        slo, penalty = cfg.atgt_slo_ms, cfg.penalty
        best = None
        for bound, gid in self.bounds:
            if best is not None and bound > best[0]:
                break
            g = by_gid[gid]
            if best is not None and bound != -_INF:
                # a lower bound of this request's cost on any member: the empty request's
                # plus what its rank and input add (a margin far above float rounding)
                lb = bound + g.extra(rank) + g.k2 * n_in
                if lb - best[0] > 1e-9 * (abs(lb) + abs(best[0]) + 1.0):
                    continue
            if adapter is None or not candidates_only:
                lists = (g.members,) if adapter is None else (g.members, g.holders.get(adapter, ()))
            else:
                h = g.holders.get(adapter)
                lists = (g.free, h) if h else (g.free,)
            for lst in lists:
                for key in lst:
                    w = views[key[-1]]
                    if candidates_only and w.kv_capacity > 0 and w.kv_used + need > w.kv_capacity:
                        continue
                    cost, violates = _cara_cost(states[key[-1]], n_in, rank, slo, penalty)
                    cand = (cost, not (adapter is None or adapter in w.adapters), w.worker_id, violates)
                    if best is None or cand < best:
                        best = cand
                    if g.ordered:
                        break
        return best
