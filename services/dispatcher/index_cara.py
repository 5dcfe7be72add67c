"""CaraServe's cost groups for `dispatcher.index` (split from index_models.py).

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
  online fits, as the live dispatcher's) groups are single workers and more of them are
  visited (see `polyserve bench dispatch --perf-spread`); so the same group entries are
  also filed per adapter: a group holding at most `NARROW` adapters under each of them
  (and, with a slot-free member, in `narrow_free`), the others in `wide`, and a request
  naming an adapter visits only those three lists (each in bound order, each stopping at
  the best cost). That costs an update up to 2·(NARROW + 1) more sorted-list operations
  and saves a decision the groups that cannot serve the adapter (p50 ~90 -> ~55 µs with
  `--perf-spread 0.05`; docs/benchmarks/dispatch.md).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from polyserve.core.perf import BGMV, LORA_DEFAULTS, MBGMV
from polyserve.dispatcher import policy_caraserve as CS
from polyserve.dispatcher.index_structs import _INF, _Struct
from polyserve.dispatcher.views import RequestView, WorkerView

NARROW = 8  # a group holding at most this many adapters is filed under each of them


class _CaraGroup:
    """Workers alike in all `cost_of` reads but their context: all members, the slot-free
    ones, and per resident adapter its holders, each a list of (context, id) keys, sorted."""

    __slots__ = ("b", "bound", "bounded", "empty_costs", "filed", "free", "gid", "holders", "k2", "kernel", "lora_extra", "members",
                 "mx", "ordered", "perf", "sig", "sm")

    sig: tuple
    perf: Any
    kernel: str
    b: int
    mx: int
    sm: int
    k2: float

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
        self.filed: tuple | None = None  # how `_Cara._file` last filed it

    def extra(self, rank: int) -> float:
        """(b+1)·(LoRA share of the step with a rank-`rank` request − with a rank-0 one): what
        a request's rank adds to the cost of every member, exactly (cost_of is separable)."""
        d = self.lora_extra.get(rank)
        if d is None:
            lora, k, b1 = self.perf.lora_ms, self.kernel, self.b + 1
            d = self.lora_extra[rank] = b1 * (lora(k, b1, max(self.mx, rank), self.sm + rank)
                                              - lora(k, b1, self.mx, self.sm))
        return d


def _batch_sums(w: WorkerView, prev: tuple | None, added) -> tuple | None:
    """(Σ(input + generated), b, max rank, Σ rank) of the worker's requests (None: it lists
    none), from `prev` (those of its requests but `added`, the one a placement appended) in
    O(1), else in one pass. Integers, so `sums[0] / b` is `_batch_state`'s mean context
    exactly; before, every placement re-summed all of the worker's requests."""
    if prev is not None and added is not None:
        tot: int; b: int; mx: int; sm: int; rank: int  # noqa: E702  (for mypyc, `native`)
        tot, b, mx, sm = prev
        rank = added.rank
        return tot + added.input_tokens + added.generated, b + 1, mx if mx >= rank else rank, sm + rank
    reqs = w.requests
    if not reqs:
        return None
    ranks = [r.rank for r in reqs]
    return sum(r.input_tokens + r.generated for r in reqs), len(reqs), max(ranks), sum(ranks)


def _fit_of(perf, kernel: str) -> tuple:
    """What `cost_of` reads of a worker's perf model and kernel, by value: (k2, c2, c3, LoRA
    coefficients, α, β, MBGMV?, bounded, ordering: 1 by context, 0 context-free, -1 none)."""
    m = perf.base
    lora = tuple(perf.lora.get(kernel, LORA_DEFAULTS[BGMV]))
    order = 1 if m.k2 > 0 and m.c2 >= 0 and m.c3 >= 0 else 0 if m.k2 == 0 else -1
    return m.k2, m.c2, m.c3, lora, lora[0], lora[1], kernel == MBGMV, m.k2 >= 0 and lora[0] >= 0, order


def _cara_signature(w: WorkerView, sums: tuple | None = None, fit: tuple | None = None
                    ) -> tuple[tuple, tuple, bool, bool, tuple]:
    """(group signature, member key, ordered, bounded, cost inputs) of a worker (see the
    module docstring); the cost inputs are what `cost_of` computes before it looks at the
    request: (k2, c2, c3, LoRA α, LoRA β, MBGMV?, b, mean context, max rank, Σ rank, step
    time now, KV room, adapters) — what `_cara_cost` and a decision read, so that neither
    fetches the perf model or the view. `sums`: its `_batch_sums` (None: computed here);
    `fit`: its `_fit_of` (None: computed here; `_Cara` keeps one per perf model)."""
    if fit is None:
        fit = _fit_of(w.perf or CS._LORA_ONLY, w.kernel)
    if sums is None and w.requests:
        sums = _batch_sums(w, None, None)
    b: int; ctx: float; mx: int; sm: int  # noqa: E702  (for mypyc, `native`: unboxed arithmetic)
    k2: float; c2: float; c3: float; alpha: float; beta: float; mbgmv: bool; bounded: bool; order: int  # noqa: E702
    if sums is not None:
        b, mx, sm = sums[1], sums[2], sums[3]
        ctx = sums[0] / b
    else:
        b, ctx, mx, sm = CS._batch_state(w)
    k2, c2, c3, lora, alpha, beta, mbgmv, bounded, order = fit
    # `policy_caraserve.step_ms` (decode_ms + lora_ms, four calls) written out: the same
    # float operations; every update computes it (fifth round)
    t0 = 0.0
    if b > 0:
        t0 = (k2 * ctx + c2) * b + c3
        if not t0 > 0.0:
            t0 = 0.0
        if mx > 0:
            x = alpha * (sm if mbgmv else b * mx) + beta
            t0 += x if x > 0.0 else 0.0
    state = (k2, c2, c3, alpha, beta, mbgmv, b, ctx, mx, sm, t0,
             w.kv_capacity - w.kv_used if w.kv_capacity > 0 else _INF, w.adapters)
    mkey = (ctx if order else 0.0, w.worker_id)  # (k2 == 0: the context does not enter the cost)
    # what `cost_of` reads of the perf model, by value: workers with equal fits share groups
    sig = (k2, c2, c3, lora, w.kernel, b, mx, sm if mbgmv else -1)
    return sig, mkey, order >= 0, bounded, state


def _cara_cost(state: tuple, n_in: int, rank: int, slo: float, penalty: float) -> tuple[float, bool]:
    """(cost, violates) of `policy_caraserve.cost_of` from a worker's cost inputs: the same
    float operations, without recomputing what does not depend on the request. The step
    time after (`policy_caraserve.step_ms` → `WorkerPerf.decode_ms` + `lora_ms`, four calls)
    is written out here from the coefficients in `state`: a decision evaluates ~3 workers,
    and those calls were a third of its time (docs/benchmarks/dispatch.md, fourth round)."""
    # (declared for mypyc, `native`: unboxed arithmetic; no cost in CPython)
    k2: float; c2: float; c3: float; alpha: float; beta: float; mbgmv: bool  # noqa: E702
    b: int; ctx: float; mx: int; sm: int; t0: float  # noqa: E702
    k2, c2, c3, alpha, beta, mbgmv, b, ctx, mx, sm, t0 = state[:11]
    b1 = b + 1
    ctx1 = (ctx * b + n_in) / b1
    t1 = (k2 * ctx1 + c2) * b1 + c3  # decode_ms: max(0, ...), batch b + 1 >= 1
    if not t1 > 0.0:
        t1 = 0.0
    mr = mx if mx >= rank else rank
    if mr > 0:  # lora_ms: BGMV on batch·max rank, MBGMV on Σ rank; max(0, α·x + β)
        lora = alpha * (sm + rank if mbgmv else b1 * mr) + beta
        t1 += lora if lora > 0.0 else 0.0
    violates = t1 > slo
    return b1 * t1 - b * t0 + (penalty if violates else 0.0), violates


def _slots_full(w: WorkerView) -> bool:
    return bool(w.max_adapters) and len(w.adapters) >= w.max_adapters


class _Cara(_Struct):
    """CaraServe's cost groups in one order of their lower bounds; a worker sits in one group
    (in its member list, its slot-free list when it has a free adapter slot, and the holder
    list of each adapter it holds), so an update touches one or two groups only."""

    LAZY = True  # a placement updates it from the entry alone (`placed_from`)

    def __init__(self, views: dict[str, WorkerView]):
        self.views = views
        self.groups: dict[tuple, _CaraGroup] = {}
        self.by_gid: dict[int, _CaraGroup] = {}
        self.bounds: list[tuple] = []  # (bound, gid, group), sorted ((bound, gid) is unique)
        self.where: dict[str, tuple] = {}  # worker_id -> (group, member key, slot-free, adapters)
        self.state: dict[str, tuple] = {}  # worker_id -> its cost inputs (`_cara_signature`)
        self.sums: dict[str, tuple] = {}  # worker_id -> `_batch_sums` of its requests
        self.fits: dict[tuple, tuple] = {}  # (id(perf), kernel) -> (perf, `_fit_of`): per model, not per update
        self._next = 0
        # The same (bound, gid, group) entries, filed for requests naming an adapter: groups
        # holding more than NARROW adapters in `wide`; the others under each adapter they
        # hold and, with a slot-free member, in `narrow_free` (see `best`).
        self.wide: list[tuple] = []
        self.by_adapter: dict[str, list[tuple]] = {}
        self.narrow_free: list[tuple] = []

    def _file(self, g: _CaraGroup) -> None:
        """Refile `g` after an update touched it, when its bound, its adapters (a narrow
        group) or whether it has a slot-free member changed."""
        now: tuple | None
        if not g.members:
            now = None
        elif len(g.holders) > NARROW:
            now = (g.bound, True, (), False)
        else:
            now = (g.bound, False, tuple(g.holders), bool(g.free))
        was = g.filed
        if now == was:
            return
        for filing, put in ((was, False), (now, True)):
            if filing is None:
                continue
            bound, wide, adapters, free = filing
            lists = [self.wide] if wide else [self.by_adapter.setdefault(a, []) for a in adapters]
            if free:
                lists.append(self.narrow_free)
            for lst in lists:
                if put:
                    insort(lst, (bound, g.gid, g))
                else:
                    del lst[bisect_left(lst, (bound, g.gid))]
            if not put:
                for a in adapters:
                    if not self.by_adapter[a]:
                        del self.by_adapter[a]
        g.filed = now

    def _rebound(self, g: _CaraGroup) -> None:
        bounds = self.bounds
        if g.members:
            bound: float | None = -_INF
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
        insort(bounds, (bound, g.gid, g))

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if old is not None:
            self._take_out(old.worker_id)
        if new is None:
            self.state.pop(old.worker_id, None)  # type: ignore[union-attr]
            self.sums.pop(old.worker_id, None)  # type: ignore[union-attr]
            return
        wid = new.worker_id
        sums = _batch_sums(new, self.sums.get(wid) if old is not None and old.requests else None, added)
        if sums is None:
            self.sums.pop(wid, None)
        else:
            self.sums[wid] = sums
        self._put_in(new, sums)

    def placed_from(self, w: WorkerView, entry) -> None:
        """`entry` placed on the worker (`_Struct.placed_from`): its batch sums from those
        kept (all of its requests so far: none when it lists none), its other cost inputs
        from `w` (a placement changes only its requests)."""
        wid = w.worker_id
        prev = self.sums.get(wid)
        self._take_out(wid)
        sums = self.sums[wid] = _batch_sums(w, (0, 0, 0, 0) if prev is None else prev, entry)  # type: ignore[assignment]
        self._put_in(w, sums)

    def _take_out(self, wid: str) -> None:
        """Remove the worker from its group's lists."""
        g: _CaraGroup
        g, mkey, free, adapters = self.where.pop(wid)
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
        self._file(g)

    def _put_in(self, new: WorkerView, sums: tuple | None) -> None:
        """File the worker (`new`: its view, or one differing only in its requests, whose
        `_batch_sums` are `sums`) in its group."""
        wid = new.worker_id
        perf = new.perf or CS._LORA_ONLY
        fit = self.fits.get((id(perf), new.kernel))
        if fit is None or fit[0] is not perf:
            if len(self.fits) > 4096:  # per-worker online fits are replaced as they refit
                self.fits.clear()
            fit = self.fits[(id(perf), new.kernel)] = (perf, _fit_of(perf, new.kernel))
        sig, mkey, ordered, bounded, state = _cara_signature(new, sums, fit[1])
        self.state[wid] = state
        g = self.groups.get(sig)
        if g is None:
            g = self.groups[sig] = _CaraGroup(self._next, ordered, bounded)
            g.sig = sig
            g.perf, g.kernel = new.perf or CS._LORA_ONLY, new.kernel
            g.b, g.mx, g.sm = state[6], state[8], state[9]
            m = g.perf.base  # the cost grows by (b+1)·k2 per input token (when it is ordered)
            g.k2 = (g.b + 1) * m.k2 if ordered and m.k2 > 0 and m.c2 >= 0 and m.c3 >= 0 else 0.0
            self.by_gid[g.gid] = g
            self._next += 1
            insort(self.bounds, (g.bound, g.gid, g))
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
        self._file(g)

    def best(self, req: RequestView, cfg: CS.CaraConfig, need: int, candidates_only: bool) -> tuple | None:
        """(cost, not resident, worker_id, violates) of the cheapest candidate (with
        `candidates_only` False: of every worker, as when there is no candidate)."""
        adapter = req.adapter
        if adapter is not None and candidates_only:  # the slot-free members and the adapter's holders
            # With per-worker online fits most groups are single workers: visit only those
            # that hold the adapter or have a free slot (and the wide ones), not every group
            # whose bound is below the best cost. A group may come twice: evaluated twice.
            sources: tuple = (self.wide, self.by_adapter.get(adapter, ()), self.narrow_free)
        else:
            sources = (self.bounds,)
        best = None
        for entries in sources:
            if entries:
                best = self._visit(entries, req, cfg, need, candidates_only, best)
        return best

    def best_among(self, req: RequestView, cfg: CS.CaraConfig, need: int, wids: list[str]) -> tuple | None:
        """`best` over the workers `wids` alone (a placement hint: dispatcher/prefer.py), as
        `policy_caraserve.rank_aware` over their views: the cheapest candidate (KV room, and the
        adapter resident or a free slot), else the cheapest of them all; None when none is indexed.
        From the cost inputs the index keeps: no view is built, no perf model called."""
        adapter, rank, n_in = req.adapter, req.adapter_rank, req.input_tokens
        slo, penalty = cfg.atgt_slo_ms, cfg.penalty
        best = None
        for only_candidates in (True, False):
            for wid in wids:
                st = self.state.get(wid)
                if st is None:
                    continue
                resident = adapter is None or adapter in st[12]
                if only_candidates and (need > st[11] or not (resident or self.where[wid][2])):
                    continue  # no KV room, or the adapter neither resident nor a free slot for it
                cost, violates = _cara_cost(st, n_in, rank, slo, penalty)
                cand = (cost, not resident, wid, violates)
                if best is None or cand < best:
                    best = cand
            if best is not None:
                return best
        return None

    def _visit(self, entries: list[tuple], req: RequestView, cfg: CS.CaraConfig, need: int,
               candidates_only: bool, best: tuple | None) -> tuple | None:
        """`best` or a cheaper candidate of the groups `entries` (sorted by bound) list."""
        states = self.state
        adapter, rank, n_in = req.adapter, req.adapter_rank, req.input_tokens
        slo, penalty = cfg.atgt_slo_ms, cfg.penalty
        some = adapter is not None and candidates_only
        best_cost = _INF if best is None else best[0]
        bound: float
        g: _CaraGroup  # (declared for mypyc: native attribute reads)
        for bound, _, g in entries:
            if bound > best_cost:
                break
            h = None if adapter is None else g.holders.get(adapter)
            if some and h is None and not g.free:
                continue  # no candidate in this group (tested first: it is the cheapest test)
            if best is not None and bound != -_INF:
                # a lower bound of this request's cost on any member: the empty request's
                # plus what its rank and input add (a margin far above float rounding).
                # First without the rank's share (>= 0 in a bounded group, LoRA α >= 0): a
                # weaker bound that needs no `extra` (with per-worker fits groups are single
                # workers, made and dropped as they move, and `extra` is mostly a cache miss)
                lb = bound + g.k2 * n_in
                if lb - best_cost > 1e-9 * (abs(lb) + abs(best_cost) + 1.0):
                    continue
                extra = g.lora_extra.get(rank)
                lb = bound + (g.extra(rank) if extra is None else extra) + g.k2 * n_in
                if lb - best_cost > 1e-9 * (abs(lb) + abs(best_cost) + 1.0):
                    continue
            if some:
                lists = (g.free, h) if h else (g.free,)
            else:
                lists = (g.members,) if h is None else (g.members, h)
            for lst in lists:
                for key in lst:
                    st = states[key[-1]]
                    if candidates_only and need > st[11]:  # no KV room (kv_used + need > capacity)
                        continue
                    cost, violates = _cara_cost(st, n_in, rank, slo, penalty)
                    cand = (cost, not (adapter is None or lst is h or adapter in st[12]), key[-1], violates)
                    if best is None or cand < best:
                        best, best_cost = cand, cost
                    if g.ordered:
                        break
        return best
