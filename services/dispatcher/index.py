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
    index.remove(worker_id)         # worker down / expired
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
  request it may take that are *necessary* for `check` to pass (most input tokens by the
  TTFT, slack and first-step KV constraints, most in + γ·predicted by ATGT, most
  in + predicted by KV for a heartbeat-only view; one token generous against rounding).
  Workers no request can fit (batch full, no room left) are left out; a decision walks
  from the fullest worker, skips those whose limits the request exceeds (O(1) each) and
  runs the real `check` on the others until one passes — O(k) plus one `check`, which is
  O(requests on that worker). The fallback (nothing fits: the emptiest, scale_out=True)
  is O(log n). Each update recomputes capacity_norm and the limits of one worker:
  O(its requests).
* caraserve: workers grouped by what `cost_of` reads besides their context (k2, c2, c3,
  the kernel's LoRA coefficients — by value —, kernel, batch b, max rank, Σ rank under
  MBGMV); within a group the cost grows with the mean context, so members sorted by
  (context, id) make the first one with KV room the group's cheapest. Groups are visited
  by a lower bound of their cost (their first member's cost for an empty, rank-0 request)
  and the scan stops when the bound exceeds the best cost found. Workers whose adapter
  slots are full sit in a separate set, and each adapter has the set of its holders, so a
  request for adapter A sees the slot-free workers and A's holders only (and the
  resident-first tie-break is exact). Needs k2 ≥ 0 and LoRA α ≥ 0 (otherwise that group
  is always scanned, still exact). With no candidate at all (no KV room or adapter slot
  anywhere) every worker competes, as in the pure policy. Exactness rests on float costs
  being ordered like the real-valued ones within a group (cost differences of ≥ k2·1
  token, far above rounding). Costs: an update moves the worker in 1 + (its resident
  adapters) sets; a decision evaluates one worker per group visited. When every worker
  has its own, different fit (per-worker online fits) groups are single workers and more
  of them are visited (see `polyserve bench-dispatch --perf-spread`).
* arlo_mlq / arlo_ilb / arlo_ig: per runtime length, instances sorted by Alg. 1's head key
  (and by ILB's key); levels by length — O(L) for L runtimes.

Not covered by the fast path (call the pure policy on a filtered `views()`): a request
with ``exclude`` (retries) and workers filtered out by max_outstanding / max_input_len
(for Arlo the levels logic already handles max_input_len, but the dispatcher answers 503
where the policy would fall back to the longest runtime). Sorted lists are plain Python
lists kept with `bisect` (`sortedcontainers` is not installed): O(log n) comparisons plus
a memmove, which is well under a microsecond at n in the thousands.
"""
from __future__ import annotations

import math
import random as _random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from operator import attrgetter

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


def _aladdin_limits(w: WorkerView, cfg: AL.AladdinConfig) -> tuple[float, float, float] | None:
    """Necessary conditions for `check(w, request)` to pass, as limits on the request:
    (most input tokens, most input + γ·predicted, most input + predicted), each one token
    generous so that float rounding never skips a feasible worker (inf = no limit); None
    when no request at all can pass (batch full, no TTFT / slack / ATGT / KV room)."""
    perf = AL._perf(w, cfg)
    b = AL._batch(w) + 1
    if w.max_batch and b > w.max_batch:
        return None
    max_in = room = max_total = _INF
    # one pass over the requests (the limits carry a margin: sums need not match `check`'s bit for bit)
    wctx, queued, prefilling, ctx, slack = 0.0, 0, 0, 0, _INF
    g, t_dec = cfg.gamma, cfg.atgt_slo_ms
    for r in w.requests:
        wctx += r.input_tokens + g * AL.planned_output(r, cfg)
        ctx += r.input_tokens + r.generated
        if not r.started:
            queued += r.input_tokens
        else:
            if r.generated == 0:
                prefilling += r.input_tokens
            slack = min(slack, t_dec * max(1, r.generated) - r.decode_ms)
    if perf is not None:
        m = perf.base
        # (b) ATGT: Σ(l_in + γ·l_out) + in + γ·pred <= θ·l_d(b)
        room = cfg.theta * perf.l_d(b, t_dec) - (wctx if w.requests else float(w.kv_used)) + 1.0
        if m.k1 > 0:
            if queued + prefilling > 0:  # (c) TTFT: prefill(queued + prefilling + in) <= T_pre
                max_in = (cfg.ttft_slo_ms - m.c1) / m.k1 - (queued + prefilling) + 1.0
            if cfg.slack == "banked":  # (d): prefill(queued + in) <= θ·slack (Alg. 1's banked slack)
                if slack < 0:
                    return None  # a prefill takes >= 0 ms
                if slack < _INF:  # (with nothing queued an empty prompt takes 0 ms: never skip it)
                    bound = (cfg.theta * slack - m.c1) / m.k1 - queued + 1.0
                    max_in = min(max_in, bound if queued else max(0.0, bound))
    if w.kv_capacity > 0:  # (e) KV: the peak is at least the footprint of the first future step
        h, j = (perf.base.h, perf.base.j) if perf is not None else (1.0, 0.0)
        if w.requests:
            if h > 0:
                n = len(w.requests) + 1
                max_in = min(max_in, (w.kv_capacity - j * n) / h - ctx - n + 1.0)
        elif perf is None:
            max_total = w.kv_capacity - w.kv_used + 1.0
        elif h > 0:
            max_total = (w.kv_capacity - w.kv_used - j) / h + 1.0
    if max_in < 0 or room < cfg.gamma or max_total < 1:
        return None  # every request has input >= 0, predicted >= 1 (as Aladdin plans it)
    return max_in, room, max_total


class _Aladdin(_Struct):
    """Workers by (−capacity_norm, id) under one config: all of them (for the fallback) and
    those some request may fit, with their `_aladdin_limits`: keys (−cn, id[, limits...])."""

    def __init__(self, cfg: AL.AladdinConfig):
        self.cfg = cfg
        self.all = _Sorted()
        self.live = _Sorted()

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if new is None:
            self.all.discard(old.worker_id)
            self.live.discard(old.worker_id)
            return
        cn = -AL.capacity_norm(new, self.cfg)
        self.all.set(new.worker_id, (cn, new.worker_id))
        limits = _aladdin_limits(new, self.cfg)
        if limits is None:
            self.live.discard(new.worker_id)  # no request can fit it: never checked
        else:
            self.live.set(new.worker_id, (cn, new.worker_id, *limits))


# ------------------------------------------------------------------ caraserve
_REQ0 = RequestView(input_tokens=0, adapter_rank=0)
_NO_PENALTY = CS.CaraConfig(penalty=0.0)


class _CaraGroup:
    __slots__ = ("bound", "bounded", "gid", "members", "ordered")

    def __init__(self, gid: int, ordered: bool, bounded: bool):
        self.gid = gid
        self.members = _Sorted()
        self.ordered = ordered  # first member with KV room is the group's cheapest
        self.bounded = bounded  # the first member's cost for an empty request bounds the group
        self.bound = -_INF


class _CaraSet:
    """Workers grouped by cost signature; groups ordered by a lower bound of their cost."""

    def __init__(self, views: dict[str, WorkerView], empty_cost: dict[str, float]):
        self.views = views
        self.empty_cost = empty_cost  # worker_id -> its cost for an empty rank-0 request
        self.groups: dict[tuple, _CaraGroup] = {}
        self.by_gid: dict[int, _CaraGroup] = {}
        self.bounds = _Sorted()  # (bound, gid-as-str)
        self.where: dict[str, tuple] = {}  # worker_id -> signature
        self._next = 0

    def remove(self, wid: str) -> None:
        sig = self.where.pop(wid, None)
        if sig is None:
            return
        g = self.groups[sig]
        first = g.members.keys[0][-1] if g.members.keys else None
        g.members.discard(wid)
        if not g.members.keys:
            del self.groups[sig]
            del self.by_gid[g.gid]
            self.bounds.discard(str(g.gid))
        elif first == wid:
            self._rebound(g)

    def add(self, w: WorkerView, sig: tuple, mkey: tuple, ordered: bool, bounded: bool) -> None:
        g = self.groups.get(sig)
        if g is None:
            g = _CaraGroup(self._next, ordered, bounded)
            self._next += 1
            self.groups[sig] = g
            self.by_gid[g.gid] = g
        first = g.members.keys[0] if g.members.keys else None
        g.members.set(w.worker_id, mkey)
        self.where[w.worker_id] = sig
        if first is None or g.members.keys[0] != first:
            self._rebound(g)

    def _rebound(self, g: _CaraGroup) -> None:
        if g.bounded and g.ordered:
            g.bound = self.empty_cost[g.members.keys[0][-1]]
        else:
            g.bound = -_INF
        self.bounds.set(str(g.gid), (g.bound, str(g.gid)))

    def best(self, req: RequestView, cfg: CS.CaraConfig, need: int, kv_filter: bool,
             best: tuple | None) -> tuple | None:
        """Improve `best` = (cost, not resident, worker_id, violates) with this set's candidates."""
        views = self.views
        adapter = req.adapter
        for bound, gid in self.bounds.keys:
            if best is not None and bound > best[0]:
                break
            g = self.by_gid[int(gid)]
            for key in g.members.keys:
                w = views[key[-1]]
                if kv_filter and w.kv_capacity > 0 and w.kv_used + need > w.kv_capacity:
                    continue
                c = CS.cost_of(w, req, cfg)
                cand = (c.cost, not (adapter is None or adapter in w.adapters), w.worker_id, c.violates)
                if best is None or cand < best:
                    best = cand
                if g.ordered:
                    break
        return best


def _cara_signature(w: WorkerView) -> tuple[tuple, tuple, bool, bool]:
    """(group signature, member key, ordered, bounded) of a worker (see the module docstring)."""
    perf = w.perf or CS._LORA_ONLY
    b, ctx, mx, sm = CS._batch_state(w)
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
    return sig, mkey, ordered, bounded


def _slots_full(w: WorkerView) -> bool:
    return bool(w.max_adapters) and len(w.adapters) >= w.max_adapters


class _Cara(_Struct):
    """Slot-free workers, slot-full workers, and per adapter its holders, each a `_CaraSet`."""

    def __init__(self, views: dict[str, WorkerView]):
        self.views = views
        self.empty_cost: dict[str, float] = {}
        self.free = _CaraSet(views, self.empty_cost)
        self.full = _CaraSet(views, self.empty_cost)
        self.holders: dict[str, _CaraSet] = {}

    def update(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if old is not None:
            (self.full if _slots_full(old) else self.free).remove(old.worker_id)
            for a in old.adapters:
                s = self.holders.get(a)
                if s is not None:
                    s.remove(old.worker_id)
                    if not s.where:
                        del self.holders[a]
        if new is None:
            self.empty_cost.pop(old.worker_id, None)
        else:
            sig = _cara_signature(new)
            if sig[2] and sig[3]:  # ordered and bounded: its groups' bound may be this cost
                self.empty_cost[new.worker_id] = CS.cost_of(new, _REQ0, _NO_PENALTY).cost
            (self.full if _slots_full(new) else self.free).add(new, *sig)
            for a in new.adapters:
                s = self.holders.get(a)
                if s is None:
                    s = self.holders[a] = _CaraSet(self.views, self.empty_cost)
                s.add(new, *sig)

    def sets_for(self, adapter: str | None, all_workers: bool) -> list[_CaraSet]:
        if adapter is None:
            return [self.free, self.full]
        out = [self.free, self.full] if all_workers else [self.free]
        if adapter in self.holders:
            out.append(self.holders[adapter])
        return out


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
        last = self._order.pop()
        if last.worker_id != worker_id:
            self._order[i] = last
            self._pos[last.worker_id] = i
        del self._ids[bisect_left(self._ids, worker_id)]
        for s in self._all_structs():
            s.update(old, None)
            s.membership_changed()
        return True

    def placed(self, worker_id: str, request: RequestView) -> WorkerView:
        """The dispatcher placed `request` on the worker: outstanding + 1 (and, tracking
        requests, it joins the worker's `requests` as a not-yet-started entry)."""
        w = self._get(worker_id)
        reqs = w.requests + (AL.as_new(request),) if self.track_requests else w.requests
        return self._set(_with_load(w, w.outstanding + 1, reqs))

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

    def _set(self, view: WorkerView) -> WorkerView:
        wid = view.worker_id
        old = self._views.get(wid)
        self._views[wid] = view
        if old is None:
            self._pos[wid] = len(self._order)
            self._order.append(view)
            insort(self._ids, wid)
        else:
            self._order[self._pos[wid]] = view
        for s in self._all_structs():
            s.update(old, view)
            if old is None:
                s.membership_changed()
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
    for key in s.live.keys:
        if need_in > key[2] or need_w > key[3] or need_t > key[4]:
            continue  # fails a constraint for sure: no need to run `check`
        if not check(views[key[1]], request, cfg):
            return Decision(key[1], state)
    keys = s.all.keys  # none fits: the emptiest by capacity_norm, lowest id among equals
    return Decision(keys[bisect_left(keys, (keys[-1][0],))][-1], state, scale_out=True)


def fast_caraserve(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
    index._require()
    cfg = CS.DEFAULT if request.atgt_slo_ms <= 0 else CS.CaraConfig(atgt_slo_ms=request.atgt_slo_ms)
    s: _Cara = index._struct("caraserve")
    need = request.input_tokens + request.predicted_tokens
    best = None
    for cs in s.sets_for(request.adapter, all_workers=False):
        best = cs.best(request, cfg, need, True, best)
    if best is None:  # no candidate: every worker competes (pure rank_aware does the same)
        for cs in s.sets_for(request.adapter, all_workers=True):
            best = cs.best(request, cfg, need, False, best)
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
