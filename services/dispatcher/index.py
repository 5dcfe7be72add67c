"""Incremental worker indexes: every dispatch policy in O(log n) or O(k), same decisions.

The policies of `policy`, `policy_aladdin`, `policy_caraserve` and `policy_arlo` are pure
functions over a list of `WorkerView`s: each decision scans every worker (O(n) Python,
hundreds of µs at 1,200 workers). A `WorkerIndex` holds one deployment's views and keeps,
per policy, a structure that is updated when one worker changes, so a decision only looks
at the few workers that can win. ``fast_<policy>(index, request, state, rng)`` returns the
*same* `Decision` as ``<policy>(index.views(), request, state, rng)`` (ties, rng draws and
policy state included); `tests/unit/test_dispatch_index.py` checks that on random clusters.
The structures live in `index_structs` (sorted orders, first-fit, Arlo queues),
`index_models` (Aladdin limits and blocks) and `index_cara` (CaraServe cost groups), with
how they stay exact.

API (what the live dispatcher calls)::

    index = WorkerIndex(policies=("aladdin",))   # one per deployment; structures are also
                                                 # built lazily on a policy's first decision
    index.upsert(view)              # heartbeat: insert or replace a worker's WorkerView
    index.remove(worker_id)         # worker down / expired (the others keep their order: O(n))
    d = FAST_POLICIES[name](index, request_view, state, rng)   # or choose_fast(name, ...)
    index.placed(d.worker_id, request_view)    # outstanding + 1, request joins `requests`
    index.finished(worker_id, request_id)      # outstanding - 1, request leaves `requests`
    index.views()                   # the views, in the order the fast policies see them
    index.get(worker_id)            # one view; index.load(worker_id): (outstanding, requests)

``placed`` / ``finished`` do what the dispatcher's own accounting does between two
heartbeats: ``outstanding`` ±1 and, with ``track_requests=True`` (default), the request
added to / removed from ``WorkerView.requests`` as Aladdin's "new" entry (`as_new`), which
is what `policy_aladdin.RequestBook` gives Aladdin and CaraServe. The next `upsert` replaces
the whole view (the caller builds it from the heartbeat, its outstanding count and book).
With aladdin's / caraserve's structures only, `placed` updates them from the new entry alone
and builds the new WorkerView when something reads it (lazy views: `get`, `views`, a
decision that needs it); an `upsert` replaces it without building it.
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
  in + predicted by KV for a heartbeat-only view; generous by 1e-9 relative against
  rounding, one token for KV) and three *sufficient* ones of the same form (as strict: the
  same bounds, and for KV the sum of each request's footprint at its last step, which
  bounds the peak from above when h >= 0). Workers no request can fit (batch full, no room
  left) are left out; the others sit in blocks of up to 16 keys with each block's maxima of
  the necessary limits (kept exact by the updates, `index_structs._Blocked`), so a decision
  skips whole blocks no worker of which can take the request, then walks from the fullest
  worker, skips those whose necessary limits the request exceeds, takes the first whose
  sufficient limits it meets without running `check`, and runs the real `check` only where
  the two disagree (near a boundary) — O(blocks + k), `check` rarely. The fallback (nothing
  fits: the least `policy_aladdin.fallback_key`, scale_out=True) scans every view —
  O(Σ requests), only when no worker fits. What the limits read of a perf model is
  computed once per model (`index_models._Consts`). An upsert recomputes one worker's sums
  in one pass (O(its requests)); `placed` adds the new request to them in place, in O(1),
  and recomputes the worker's key from them and its model's constants alone — the
  Σ(l_in + γ·l_out) that `capacity_norm` reads stays bit-identical because CPython's `sum`
  adds floats left to right (< 3.12; on 3.12+ `capacity_norm` itself is called).
* caraserve: cost groups of workers alike but for their context, visited in the order of
  a lower bound of their cost (see `index_cara`) — one worker evaluated per group visited;
  a request naming an adapter visits the groups holding it or with a free slot only.
* arlo_mlq / arlo_ilb / arlo_ig: per runtime length, instances sorted by Alg. 1's head key
  (and by ILB's key); levels by length — O(L) for L runtimes.

Not covered by the fast path (call the pure policy on a filtered `views()`): a request
with ``exclude`` (retries) and workers filtered out by max_outstanding / max_input_len
(for Arlo the levels logic already handles max_input_len, but the dispatcher answers 503
where the policy would fall back to the longest runtime). `dispatcher.liveview` does
exactly that: one index per deployment, the scan for those requests. Sorted lists are
plain lists kept with `bisect`: O(log n) comparisons plus a memmove (< 1 µs at n ~ 1,000s).
"""
from __future__ import annotations

import random as _random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from polyserve.dispatcher import policy as P
from polyserve.dispatcher import policy_aladdin as AL
from polyserve.dispatcher import policy_arlo as AR
from polyserve.dispatcher import policy_caraserve as CS
from polyserve.dispatcher.index_cara import _Cara
from polyserve.dispatcher.index_models import _Aladdin
from polyserve.dispatcher.index_structs import _Arlo, _FirstFit, _KeyOrder, _Struct, _tokens_key, _with_load
from polyserve.dispatcher.views import Decision, PolicyState, RequestView, WorkerView

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
        # Placements not yet in `_views` (lazy views): worker -> the entries placed on it since
        # its view was last built. With requests tracked and only structures that update
        # from the entry alone (aladdin's, caraserve's: `placed_from`), `placed` leaves the
        # WorkerView as it is; the view is built when something reads it (`_fresh`), and a
        # heartbeat's upsert, which replaces it, never builds it. Building it was ~2 µs of a
        # placement's ~13 (fifth round, docs/benchmarks/dispatch.md).
        self._pending: dict[str, list] = {}
        self._lazy = False  # on with a LAZY structure and no other (`_fill`), tracking requests
        self._lazy_ok = track_requests
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
            return _FirstFit(self._ids, self._views)
        if name == "caraserve":
            return _Cara(self._views)
        if name == "arlo":
            return _Arlo()
        raise KeyError(name)

    def _fill(self, s: _Struct) -> _Struct:
        self._fresh_all()
        for v in self._views.values():
            s.update(None, v)
        s.membership_changed()
        self._lazy_ok = self._lazy_ok and s.LAZY
        self._lazy = self._lazy_ok and (s.LAZY or self._lazy)
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
            s = self._aladdin[key] = self._fill(_Aladdin(cfg))  # type: ignore[assignment]
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
        self._pending.pop(worker_id, None)
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

    def placed(self, worker_id: str, request: RequestView, entry=None) -> None:
        """The dispatcher placed `request` on the worker: outstanding + 1 (and, tracking
        requests, it joins the worker's `requests` as a not-yet-started entry: `entry`, when
        the caller has made it already, must be `policy_aladdin.as_new(request)`). The view
        may be built later (`get`, `views` and `load` see the placement at once)."""
        w = self._views.get(worker_id)
        if w is None:
            w = self._get(worker_id)  # (raises the KeyError that says what to do)
        if not self.track_requests:
            self._set(_with_load(w, w.outstanding + 1, w.requests))
            return
        if entry is None:
            entry = AL.as_new(request)
        if self._lazy and self._placed_lazily(w, entry):
            return
        w = self._fresh(worker_id)
        self._set(_with_load(w, w.outstanding + 1, w.requests + (entry,)), entry)

    def _placed_lazily(self, w: WorkerView, entry) -> bool:
        """`placed` without building the view (lazy views); False when an aladdin structure
        declines (its view lists no requests), nothing done."""
        al = self._aladdin
        if len(al) > 1 and not all(s.can_place(w.worker_id) for s in al.values()):
            return False
        for s in al.values():  # (first: with one structure, it may decline, nothing done yet)
            if not s.placed_from(w, entry):
                return False
        for t in self._structs.values():
            t.placed_from(w, entry)
        pend = self._pending.get(w.worker_id)
        if pend is None:
            self._pending[w.worker_id] = [entry]
        else:
            pend.append(entry)
        return True

    def load(self, worker_id: str) -> tuple[int, int] | None:
        """(outstanding, requests listed) of the worker's current view, without building it
        (None: not indexed)."""
        w = self._views.get(worker_id)
        if w is None:
            return None
        n = len(self._pending.get(worker_id, ()))
        return w.outstanding + n, len(w.requests) + n

    def _fresh(self, worker_id: str) -> WorkerView:
        """The worker's view with the placements not yet built into it (lazy views)."""
        w = self._views[worker_id]
        pend = self._pending.pop(worker_id, None)
        if pend is not None:
            w = self._views[worker_id] = _with_load(w, w.outstanding + len(pend), w.requests + tuple(pend))
            self._order[self._pos[worker_id]] = w
        return w

    def _fresh_all(self) -> None:
        for wid in list(self._pending):
            self._fresh(wid)

    def finished(self, worker_id: str, request: RequestView | str) -> WorkerView | None:
        """A request placed on the worker completed or failed: outstanding − 1 and, tracking
        requests, it leaves `requests` (a request not there is a duplicate event: no change).
        None when the worker is gone."""
        if worker_id not in self._views:
            return None
        w = self._fresh(worker_id)
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
        # a heartbeat's view replaces the placements not yet built in (the structures read
        # only `old.worker_id` when `added` is None: the stale `old` will do)
        self._pending.pop(wid, None)
        self._views[wid] = view
        if old is None:
            self._pos[wid] = len(self._order)
            self._order.append(view)
            insort(self._ids, wid)
        else:
            self._order[self._pos[wid]] = view
        for s in self._structs.values():
            s.update(old, view, added)
            if old is None:
                s.membership_changed()
        for s in self._aladdin.values():
            s.update(old, view, added)
        return view

    # -- reads --------------------------------------------------------------------
    def views(self) -> list[WorkerView]:
        """The indexed views, in the order random / power_of_two draw from."""
        if self._pending:
            self._fresh_all()
        return list(self._order)

    def get(self, worker_id: str) -> WorkerView | None:
        if worker_id in self._pending:
            return self._fresh(worker_id)
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
    if index._pending:  # (their views with the placements not built in yet)
        a, b = index._fresh(a.worker_id), index._fresh(b.worker_id)
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
    need_in, out = request.input_tokens, AL.new_output(request)
    need_w = need_in + cfg.gamma * out
    need_t = need_in + out
    live = s.live
    maxes = live.maxes
    # the walk is inlined (no generator, no per-block call): it runs over ~13 blocks per decision
    for i, blk in enumerate(live.blocks):
        mx = maxes[i]
        if need_in > mx[0] or need_w > mx[1] or need_t > mx[2]:
            continue  # no key of this block can take it (the maxima are exact: `_Blocked`)
        for key in blk:
            if need_in > key[2] or need_w > key[3] or need_t > key[4]:
                continue  # fails a constraint for sure: no need to run `check`
            if need_in <= key[5] and need_w <= key[6] and need_t <= key[7]:
                return Decision(key[1], state)  # passes every constraint for sure
            if not AL.check(index.get(key[1]), request, cfg):  # type: ignore[arg-type]
                return Decision(key[1], state)
    # none fits: where it does the least harm (the pure policy's fallback, over every view)
    return Decision(AL.fallback(index.views(), request, cfg), state, scale_out=True)


def fast_caraserve(index: WorkerIndex, request: RequestView, state: PolicyState, rng) -> Decision:
    index._require()
    cfg = CS.config_for(request)
    s: _Cara = index._struct("caraserve")
    need = request.input_tokens + request.predicted_tokens
    best = s.best(request, cfg, need, True)
    if best is None:  # no candidate: every worker competes (pure rank_aware does the same)
        best = s.best(request, cfg, need, False)
    return Decision(best[2], state, scale_out=best[3])  # type: ignore[index]


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

FAST_POLICIES: Mapping[str, FastPolicy] = MappingProxyType({
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
})
"""Policy name (every name of `policy.POLICIES`) -> its indexed twin, read-only."""

PURE_POLICIES: Mapping[str, P.Policy] = P.POLICIES
"""The pure function each fast policy reproduces (`policy.POLICIES` itself)."""


def choose_fast(policy_name: str, index: WorkerIndex, request: RequestView, state: PolicyState,
                rng: _random.Random) -> Decision:
    """Run the indexed twin of the named policy."""
    try:
        fn = FAST_POLICIES[policy_name]
    except KeyError:
        raise P.UnknownPolicy(policy_name) from None
    return fn(index, request, state, rng)
