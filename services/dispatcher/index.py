"""Incremental worker indexes: every dispatch policy in O(log n) or O(k), same decisions.

The policies of `policy`, `policy_aladdin`, `policy_caraserve` and `policy_arlo` are pure
functions over a list of `WorkerView`s: each decision scans every worker (O(n) Python,
hundreds of µs at 1,200 workers). A `WorkerIndex` holds one deployment's views and keeps,
per policy, a structure that is updated when one worker changes, so a decision only looks
at the few workers that can win. ``fast_<policy>(index, request, state, rng)`` returns the
*same* `Decision` as ``<policy>(index.views(), request, state, rng)`` (ties, rng draws and
policy state included); `tests/unit/test_dispatch_index.py` checks that on random clusters.

API (what the live dispatcher calls)::

    index = WorkerIndex(policies=("aladdin",))   # one per deployment; structures are also
                                                 # built lazily on a policy's first decision
    index.upsert(view)              # heartbeat: insert or replace a worker's WorkerView
    index.remove(worker_id)         # worker down / expired (the others keep their order: O(n))
    d = FAST_POLICIES[name](index, request_view, state, rng)   # or choose_fast(name, ...)
    index.placed(d.worker_id, request_view)    # outstanding + 1, request joins `requests`
    index.finished(worker_id, request_id)      # outstanding - 1, request leaves `requests`
    index.views()                   # the views, in the order the fast policies see them

``placed`` / ``finished`` do what the dispatcher's own accounting does between two
heartbeats: ``outstanding`` ±1 and, with ``track_requests=True`` (default), the request
added to / removed from ``WorkerView.requests`` as Aladdin's "new" entry (`as_new`), which
is what `policy_aladdin.RequestBook` gives Aladdin and CaraServe. The next `upsert` replaces
the whole view (the caller builds it from the heartbeat, its outstanding count and book).
Decisions are exact for the views the index holds: views whose `requests` carry time-based
estimates (`RequestBook.requests(now)`) are as fresh as their last `upsert` (heartbeat or
first-token event), where the pure policy would see them at `now`.

What each structure costs per decision (n workers) and what it assumes:

* round_robin: the sorted ids, `bisect` — O(log n). random / power_of_two: the views
  list, the same rng calls as the pure policy — O(1).
* least_outstanding: a sorted list by `load_key` — O(1) read.
* least_loaded: a sorted list by (token load, in flight, id) — O(1) read.
* first_fit: a max segment tree over the workers in id order, leaf = free KV tokens
  (−inf without a free batch slot): the leftmost leaf ≥ the request's need — O(log n);
  rebuilt (O(n)) at the first decision after a worker joins or leaves.
* aladdin: per SLO pair, workers sorted by (−capacity_norm, id), each with limits on the
  request it may take: three *necessary* for `check` to pass (most input tokens by the
  TTFT, slack and first-step KV constraints, most in + γ·predicted by ATGT, most
  in + predicted by KV for a heartbeat-only view; one token generous against rounding) and
  three *sufficient* ones of the same form (a margin strict: the same bounds, and for KV the
  sum of each request's footprint at its last step, which bounds the peak from above when
  h >= 0). Workers no request can fit (batch full, no room left) are left out; the others
  sit in blocks of up to 16 keys with each block's largest necessary limits, so a decision
  skips whole blocks no worker of which can take the request, then walks from the fullest
  worker, skips those whose necessary limits the request exceeds, takes the first whose
  sufficient limits it meets without running `check`, and runs the real `check` only where
  the two disagree (near a boundary) — O(blocks + k), `check` rarely. The fallback (nothing
  fits: the least `policy_aladdin.fallback_key`, scale_out=True) scans every view —
  O(Σ requests), only when no worker fits. An upsert recomputes one worker's sums
  in one pass (O(its requests)); `placed` adds the new request to them in O(1) — the
  Σ(l_in + γ·l_out) that `capacity_norm` reads stays bit-identical because CPython's `sum`
  adds floats left to right (< 3.12; on 3.12+ `capacity_norm` itself is called).
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
  `polyserve bench-dispatch --perf-spread`).
* arlo_mlq / arlo_ilb / arlo_ig: per runtime length, instances sorted by Alg. 1's head key
  (and by ILB's key); levels by length — O(L) for L runtimes.

Not covered by the fast path (call the pure policy on a filtered `views()`): a request
with ``exclude`` (retries) and workers filtered out by max_outstanding / max_input_len
(for Arlo the levels logic already handles max_input_len, but the dispatcher answers 503
where the policy would fall back to the longest runtime). `dispatcher.handlers` does
exactly that: one index per deployment, the scan for those requests. Sorted lists are plain Python
lists kept with `bisect` (`sortedcontainers` is not installed): O(log n) comparisons plus
a memmove, which is well under a microsecond at n in the thousands.
"""
from __future__ import annotations

import math
import random as _random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from operator import attrgetter, itemgetter

from polyserve.dispatcher import policy as P
from polyserve.dispatcher import policy_aladdin as AL
from polyserve.dispatcher import policy_arlo as AR
from polyserve.dispatcher import policy_caraserve as CS
from polyserve.dispatcher.perf_models import BGMV, LORA_DEFAULTS, MBGMV
from polyserve.dispatcher.policy import Decision, PolicyState, RequestView, WorkerView

_INF = math.inf
_FIELDS = [f.name for f in fields(WorkerView)]
_GET_ALL = attrgetter(*_FIELDS)
_I_OUT, _I_REQS = _FIELDS.index("outstanding"), _FIELDS.index("requests")


def _with_load(w: WorkerView, outstanding: int, requests: tuple) -> WorkerView:
    """`replace(w, outstanding=..., requests=...)`, twice as fast (on every placement)."""
    values = list(_GET_ALL(w))
    values[_I_OUT], values[_I_REQS] = outstanding, requests
    return WorkerView(*values)


class _Sorted:
    """Keys kept sorted in a list, one per worker id; each key holds its id, so keys are unique."""

    __slots__ = ("cur", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.cur: dict[str, tuple] = {}

    def set(self, wid: str, key: tuple) -> None:
        old = self.cur.get(wid)
        if old is not None:
            if old == key:
                return
            del self.keys[bisect_left(self.keys, old)]
        insort(self.keys, key)
        self.cur[wid] = key

    def discard(self, wid: str) -> None:
        old = self.cur.pop(wid, None)
        if old is not None:
            del self.keys[bisect_left(self.keys, old)]

    def __len__(self) -> int:
        return len(self.keys)


_G2, _G3, _G4 = itemgetter(2), itemgetter(3), itemgetter(4)


class _Blocked:
    """Aladdin's live keys (−cn, id, max_in, room, max_total, ...) sorted, in blocks of at most
    `2·B` (8 -> 16) with the per-block maxima of the three necessary limits (recomputed lazily), so that a
    decision skips a whole block no key of which can take the request."""

    __slots__ = ("blocks", "cur", "lasts", "maxes")
    B = 8

    def __init__(self) -> None:
        self.blocks: list[list[tuple]] = []
        self.lasts: list[tuple] = []  # each block's last key (to find a key's block)
        self.maxes: list[tuple | None] = []  # None: to recompute
        self.cur: dict[str, tuple] = {}

    @property
    def keys(self) -> list[tuple]:
        return [k for blk in self.blocks for k in blk]

    def __len__(self) -> int:
        return len(self.cur)

    def set(self, wid: str, key: tuple) -> None:
        old = self.cur.get(wid)
        if old is not None:
            if old == key:
                return
            self._del(old)
        self._ins(key)
        self.cur[wid] = key

    def discard(self, wid: str) -> None:
        old = self.cur.pop(wid, None)
        if old is not None:
            self._del(old)

    def _ins(self, key: tuple) -> None:
        blocks, lasts = self.blocks, self.lasts
        if not blocks:
            blocks.append([key])
            lasts.append(key)
            self.maxes.append(None)
            return
        i = bisect_left(lasts, key)
        if i == len(blocks):
            i -= 1
        blk = blocks[i]
        insort(blk, key)
        lasts[i] = blk[-1]
        mx = self.maxes[i]
        if mx is not None:
            self.maxes[i] = (max(mx[0], key[2]), max(mx[1], key[3]), max(mx[2], key[4]))
        if len(blk) > 2 * self.B:
            a, b = blk[:self.B], blk[self.B:]
            blocks[i:i + 1] = [a, b]
            lasts[i:i + 1] = [a[-1], b[-1]]
            self.maxes[i:i + 1] = [None, None]

    def _del(self, key: tuple) -> None:
        lasts = self.lasts
        i = bisect_left(lasts, key)
        blk = self.blocks[i]
        del blk[bisect_left(blk, key)]
        if not blk:
            del self.blocks[i], lasts[i], self.maxes[i]
            return
        lasts[i] = blk[-1]
        mx = self.maxes[i]
        if mx is not None and (key[2] == mx[0] or key[3] == mx[1] or key[4] == mx[2]):
            self.maxes[i] = None

    def first(self, need_in: float, need_w: float, need_t: float):
        """The keys, in order, of the blocks where some key may take the request."""
        maxes = self.maxes
        for i, blk in enumerate(self.blocks):
            mx = maxes[i]
            if mx is None:
                mx = maxes[i] = (max(map(_G2, blk)), max(map(_G3, blk)), max(map(_G4, blk)))
            if need_in > mx[0] or need_w > mx[1] or need_t > mx[2]:
                continue
            yield from blk


class _Struct:
    """One policy's structure: told of every change of one worker's view."""

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        raise NotImplementedError

    def membership_changed(self) -> None:
        """A worker joined or left (after `update`)."""


# ------------------------------------------------------------------ simple keyed orders
class _KeyOrder(_Struct):
    def __init__(self, key: Callable[[WorkerView], tuple]):
        self.key = key
        self.sorted = _Sorted()

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if new is None:
            self.sorted.discard(old.worker_id)
        else:
            self.sorted.set(new.worker_id, self.key(new))


def _tokens_key(w: WorkerView) -> tuple:
    return (P._token_load(w), P._in_flight(w), w.worker_id)


# ------------------------------------------------------------------ first fit
def _free_kv(w: WorkerView) -> float:
    """first_fit leaf: free KV tokens when a batch slot is free, else −inf."""
    if P._in_flight(w) >= (w.max_batch or P.FIRST_FIT_DEFAULT_BATCH):
        return -_INF
    if w.kv_capacity <= 0:
        return _INF
    return float(w.kv_capacity - w.kv_used)


class _FirstFit(_Struct):
    """Max segment tree over `_free_kv` of the workers in worker_id order."""

    def __init__(self, index: WorkerIndex):
        self.index = index
        self.dirty = True
        self.size = 1
        self.tree: list[float] = []

    def membership_changed(self) -> None:
        self.dirty = True

    def _rebuild(self) -> None:
        ids, views = self.index._ids, self.index._views
        size = 1
        while size < max(1, len(ids)):
            size *= 2
        t = [-_INF] * (2 * size)
        for i, wid in enumerate(ids):
            t[size + i] = _free_kv(views[wid])
        for i in range(size - 1, 0, -1):
            t[i] = max(t[2 * i], t[2 * i + 1])
        self.size, self.tree, self.dirty = size, t, False

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if self.dirty or old is None or new is None:
            self.dirty = True  # a worker joined or left: positions move
            return
        i = bisect_left(self.index._ids, new.worker_id) + self.size
        t = self.tree
        v = _free_kv(new)
        if t[i] == v:
            return
        t[i] = v
        i //= 2
        while i:
            m = max(t[2 * i], t[2 * i + 1])
            if t[i] == m:
                break
            t[i] = m
            i //= 2

    def leftmost(self, need: float) -> str | None:
        if self.dirty:
            self._rebuild()
        t = self.tree
        if not t or t[1] < need:
            return None
        i, size = 1, self.size
        while i < size:
            i = 2 * i if t[2 * i] >= need else 2 * i + 1
        return self.index._ids[i - size]


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


# ------------------------------------------------------------------ arlo
def _ilb_key(w: WorkerView) -> tuple:
    return (w.outstanding, AR.congestion(w), w.worker_id)


class _Arlo(_Struct):
    """Per runtime length: instances by Alg. 1's head key and by ILB's key."""

    def __init__(self) -> None:
        self.lengths: list[float] = []
        self.head: dict[float, _Sorted] = {}
        self.ilb: dict[float, _Sorted] = {}
        self.where: dict[str, float] = {}

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if old is not None:
            n = self.where.pop(old.worker_id)
            if new is None or AR.runtime_length(new) != n:
                self.head[n].discard(old.worker_id)
                self.ilb[n].discard(old.worker_id)
                if not self.head[n]:
                    del self.head[n], self.ilb[n]
                    del self.lengths[bisect_left(self.lengths, n)]
        if new is not None:
            n = AR.runtime_length(new)
            if n not in self.head:
                self.head[n], self.ilb[n] = _Sorted(), _Sorted()
                insort(self.lengths, n)
            self.head[n].set(new.worker_id, AR._head_key(new))
            self.ilb[n].set(new.worker_id, _ilb_key(new))
            self.where[new.worker_id] = n

    def candidate_levels(self, input_tokens: int) -> list[float]:
        lens = self.lengths
        i = bisect_left(lens, input_tokens)
        return lens[i:] if i < len(lens) else lens[-1:]


# ------------------------------------------------------------------ the index
_NEEDS: dict[str, tuple[str, ...]] = {
    "round_robin": (), "random": (), "power_of_two": (),
    "least_outstanding": ("load",), "least_loaded": ("tokens",), "first_fit": ("first_fit", "load"),
    "aladdin": (), "caraserve": ("caraserve",), "arlo_mlq": ("arlo",), "arlo_ilb": ("arlo",),
    "arlo_ig": ("arlo",),
}
MAX_ALADDIN_CONFIGS = 8  # distinct (TTFT, ATGT) SLO pairs indexed per deployment


class WorkerIndex:
    """One deployment's workers and the per-policy structures (see the module docstring)."""

    def __init__(self, policies: Iterable[str] = (), *, track_requests: bool = True):
        self.track_requests = track_requests
        self._views: dict[str, WorkerView] = {}
        self._order: list[WorkerView] = []  # random / power_of_two draw from this list
        self._pos: dict[str, int] = {}
        self._ids: list[str] = []  # sorted
        self._structs: dict[str, _Struct] = {}
        self._aladdin: dict[tuple[float, float], _Aladdin] = {}
        for name in policies:
            self.prepare(name)

    # -- structures ---------------------------------------------------------------
    def prepare(self, policy_name: str) -> None:
        """Build the structures `policy_name` needs now (otherwise at its first decision)."""
        if policy_name not in _NEEDS:
            raise P.UnknownPolicy(policy_name)
        for s in _NEEDS[policy_name]:
            self._struct(s)
        if policy_name == "aladdin":
            self._aladdin_for(AL.DEFAULT)

    def _make(self, name: str) -> _Struct:
        if name == "load":
            return _KeyOrder(P.load_key)
        if name == "tokens":
            return _KeyOrder(_tokens_key)
        if name == "first_fit":
            return _FirstFit(self)
        if name == "caraserve":
            return _Cara(self._views)
        if name == "arlo":
            return _Arlo()
        raise KeyError(name)

    def _fill(self, s: _Struct) -> _Struct:
        for v in self._views.values():
            s.update(None, v)
        s.membership_changed()
        return s

    def _struct(self, name: str):
        s = self._structs.get(name)
        if s is None:
            s = self._structs[name] = self._fill(self._make(name))
        return s

    def _aladdin_for(self, cfg: AL.AladdinConfig) -> _Aladdin | None:
        key = (cfg.ttft_slo_ms, cfg.atgt_slo_ms)
        s = self._aladdin.get(key)
        if s is None:
            if len(self._aladdin) >= MAX_ALADDIN_CONFIGS:
                return None
            s = self._aladdin[key] = self._fill(_Aladdin(cfg))
        return s

    def _all_structs(self) -> list[_Struct]:
        return [*self._structs.values(), *self._aladdin.values()]

    # -- updates ------------------------------------------------------------------
    def upsert(self, view: WorkerView) -> None:
        """Insert or replace a worker's view (a heartbeat, or the caller's own accounting)."""
        if not isinstance(view, WorkerView):
            raise TypeError(f"upsert needs a WorkerView, got {type(view).__name__}")
        self._set(view)

    def remove(self, worker_id: str) -> bool:
        """Forget a worker; True when it was indexed."""
        old = self._views.pop(worker_id, None)
        if old is None:
            return False
        i = self._pos.pop(worker_id)
        order, pos = self._order, self._pos
        del order[i]  # keep the insertion order (as the dispatcher's registry does): O(n), rare
        for k in range(i, len(order)):
            pos[order[k].worker_id] = k
        del self._ids[bisect_left(self._ids, worker_id)]
        for s in self._all_structs():
            s.update(old, None)
            s.membership_changed()
        return True

    def placed(self, worker_id: str, request: RequestView) -> WorkerView:
        """The dispatcher placed `request` on the worker: outstanding + 1 (and, tracking
        requests, it joins the worker's `requests` as a not-yet-started entry)."""
        w = self._get(worker_id)
        if not self.track_requests:
            return self._set(_with_load(w, w.outstanding + 1, w.requests))
        entry = AL.as_new(request)
        return self._set(_with_load(w, w.outstanding + 1, w.requests + (entry,)), entry)

    def finished(self, worker_id: str, request: RequestView | str) -> WorkerView | None:
        """A request placed on the worker completed or failed: outstanding − 1 and, tracking
        requests, it leaves `requests` (a request not there is a duplicate event: no change).
        None when the worker is gone."""
        w = self._views.get(worker_id)
        if w is None:
            return None
        rid = request if isinstance(request, str) else request.request_id
        reqs = w.requests
        if self.track_requests:
            for i, r in enumerate(reqs):
                if r.request_id == rid:
                    reqs = reqs[:i] + reqs[i + 1:]
                    break
            else:
                return w  # not (or no longer) on this worker: a duplicate event
        return self._set(_with_load(w, max(0, w.outstanding - 1), reqs))

    def _get(self, worker_id: str) -> WorkerView:
        try:
            return self._views[worker_id]
        except KeyError:
            raise KeyError(f"worker {worker_id!r} is not in the index; upsert its view first") from None

    def _set(self, view: WorkerView, added=None) -> WorkerView:
        wid = view.worker_id
        old = self._views.get(wid)
        self._views[wid] = view
        if old is None:
            self._pos[wid] = len(self._order)
            self._order.append(view)
            insort(self._ids, wid)
        else:
            self._order[self._pos[wid]] = view
        for s in self._structs.values():
            s.update(old, view)
            if old is None:
                s.membership_changed()
        for s in self._aladdin.values():
            s.update(old, view, added)
        return view

    # -- reads --------------------------------------------------------------------
    def views(self) -> list[WorkerView]:
        """The indexed views, in the order random / power_of_two draw from."""
        return list(self._order)

    def get(self, worker_id: str) -> WorkerView | None:
        return self._views.get(worker_id)

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._views

    def _require(self) -> None:
        if not self._views:
            raise ValueError("a dispatch policy needs at least one candidate worker (the index is empty)")


# ------------------------------------------------------------------ fast policies
def fast_round_robin(index: WorkerIndex, request: RequestView, state: PolicyState,
                     rng: _random.Random) -> Decision:
    index._require()
    ids = index._ids
    i = bisect_right(ids, state.last_worker)
    chosen = ids[i] if i < len(ids) else ids[0]
    return Decision(chosen, replace(state, last_worker=chosen))


def fast_least_outstanding(index: WorkerIndex, request: RequestView, state: PolicyState,
                           rng: _random.Random) -> Decision:
    index._require()
    return Decision(index._struct("load").sorted.keys[0][-1], state)


def fast_power_of_two(index: WorkerIndex, request: RequestView, state: PolicyState,
                      rng: _random.Random) -> Decision:
    index._require()
    order = index._order
    if len(order) == 1:
        return Decision(order[0].worker_id, state)
    a, b = rng.sample(order, 2)
    return Decision(min(a, b, key=P.load_key).worker_id, state)


def fast_random(index: WorkerIndex, request: RequestView, state: PolicyState,
                rng: _random.Random) -> Decision:
    index._require()
    return Decision(rng.choice(index._order).worker_id, state)


def fast_least_loaded(index: WorkerIndex, request: RequestView, state: PolicyState,
                      rng: _random.Random) -> Decision:
    index._require()
    return Decision(index._struct("tokens").sorted.keys[0][-1], state)


def fast_first_fit(index: WorkerIndex, request: RequestView, state: PolicyState,
                   rng: _random.Random) -> Decision:
    index._require()
    wid = index._struct("first_fit").leftmost(request.input_tokens + request.predicted_tokens)
    if wid is None:
        wid = index._struct("load").sorted.keys[0][-1]
    return Decision(wid, state)


def fast_aladdin(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
    index._require()
    cfg = AL.config_for(request)
    s = index._aladdin_for(cfg)
    if s is None:  # more distinct SLO pairs than indexed: the pure scan
        return AL.aladdin_best_fit(index.views(), request, state, rng)
    views = index._views
    check = AL.check
    need_in = request.input_tokens
    need_w = need_in + cfg.gamma * max(1, request.predicted_tokens)
    need_t = need_in + max(1, request.predicted_tokens)
    for key in s.live.first(need_in, need_w, need_t):
        if need_in > key[2] or need_w > key[3] or need_t > key[4]:
            continue  # fails a constraint for sure: no need to run `check`
        if need_in <= key[5] and need_w <= key[6] and need_t <= key[7]:
            return Decision(key[1], state)  # passes every constraint for sure
        if not check(views[key[1]], request, cfg):
            return Decision(key[1], state)
    # none fits: where it does the least harm (the pure policy's fallback, over every view)
    return Decision(AL.fallback(views.values(), request, cfg), state, scale_out=True)


def fast_caraserve(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
    index._require()
    cfg = CS.DEFAULT if request.atgt_slo_ms <= 0 else CS.CaraConfig(atgt_slo_ms=request.atgt_slo_ms)
    s: _Cara = index._struct("caraserve")
    need = request.input_tokens + request.predicted_tokens
    best = s.best(request, cfg, need, True)
    if best is None:  # no candidate: every worker competes (pure rank_aware does the same)
        best = s.best(request, cfg, need, False)
    return Decision(best[2], state, scale_out=best[3])


def make_fast_arlo_mlq(lam: float = AR.DEFAULT_LAMBDA, alpha: float = AR.DEFAULT_ALPHA,
                       max_levels: int = AR.DEFAULT_LEVELS):
    """The indexed twin of `policy_arlo.make_arlo_mlq(lam, alpha, max_levels)`."""
    if not 0 < lam or not 0 < alpha <= 1 or max_levels < 1:
        raise ValueError("need lam > 0, 0 < alpha <= 1 and max_levels >= 1")

    def fast_arlo_mlq(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
        index._require()
        s: _Arlo = index._struct("arlo")
        cand = s.candidate_levels(request.input_tokens)[:max_levels]
        threshold = lam
        for n in cand:
            key = s.head[n].keys[0]
            if key[0] < threshold:
                return Decision(key[-1], state)
            threshold *= alpha
        return Decision(s.head[cand[0]].keys[0][-1], state)

    return fast_arlo_mlq


fast_arlo_mlq = make_fast_arlo_mlq()


def fast_arlo_ilb(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
    index._require()
    s: _Arlo = index._struct("arlo")
    return Decision(s.ilb[s.candidate_levels(request.input_tokens)[0]].keys[0][-1], state)


def fast_arlo_ig(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
    index._require()
    s: _Arlo = index._struct("arlo")
    best = min((s.head[n].keys[0][0], n, s.head[n].keys[0][1], s.head[n].keys[0][-1])
               for n in s.candidate_levels(request.input_tokens))
    return Decision(best[-1], state)


FastPolicy = Callable[[WorkerIndex, RequestView, PolicyState, _random.Random], Decision]

FAST_POLICIES: dict[str, FastPolicy] = {
    "round_robin": fast_round_robin,
    "least_outstanding": fast_least_outstanding,
    "power_of_two": fast_power_of_two,
    "random": fast_random,
    "least_loaded": fast_least_loaded,
    "first_fit": fast_first_fit,
    "aladdin": fast_aladdin,
    "caraserve": fast_caraserve,
    "arlo_mlq": fast_arlo_mlq,
    "arlo_ilb": fast_arlo_ilb,
    "arlo_ig": fast_arlo_ig,
}
"""Policy name (as in `policy.POLICIES`) -> its indexed twin."""

PURE_POLICIES: dict[str, P.Policy] = {
    "round_robin": P.round_robin, "least_outstanding": P.least_outstanding,
    "power_of_two": P.power_of_two, "random": P.random_choice, "least_loaded": P.least_loaded,
    "first_fit": P.first_fit, "aladdin": AL.aladdin_best_fit, "caraserve": CS.caraserve_rank_aware,
    "arlo_mlq": AR.arlo_mlq, "arlo_ilb": AR.arlo_ilb, "arlo_ig": AR.arlo_ig,
}
"""The pure function each fast policy reproduces."""


def choose_fast(policy_name: str, index: WorkerIndex, request: RequestView, state: PolicyState,
                rng: _random.Random) -> Decision:
    """Run the indexed twin of the named policy."""
    try:
        fn = FAST_POLICIES[policy_name]
    except KeyError:
        raise P.UnknownPolicy(policy_name) from None
    return fn(index, request, state, rng)
