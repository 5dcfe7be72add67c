"""`LiveView`: the dispatcher's whole in-memory state and the decisions made over it.

It owns the live worker registry (heartbeats, TTLs, tombstones), this dispatcher's
outstanding placements, the model book of aladdin/caraserve (`live.ModelBook`: placed
requests, fitted models) and, per deployment, a `dispatcher.index.WorkerIndex` with what
tells whether it may answer a request (`_DepIndex`). The handlers feed it events and ask
it for decisions; it does no I/O, so it is tested without NATS or Redis.

With `index` on (the default; `POLYSERVE_DISPATCHER_INDEX=false` turns it off) a worker's
view is rebuilt and upserted in its deployment's index whenever something it is made of
changes — its heartbeat, the outstanding count (completed/failed, expiry), and for
aladdin/caraserve its `ModelBook` entries and fit (first_token, completed/failed, moves; the
sweep refreshes them every `sweep_s` as well) — and the policy's fast twin answers in
O(log n) instead of a scan over freshly built views. A placement updates the chosen
worker's indexed view in place (outstanding + 1 and, for aladdin/caraserve, the request
appended as the book's newest entry: `WorkerIndex.placed`) instead of rebuilding it. The scan still
answers, over the filtered list exactly as before, a request with `exclude`, a deployment
with a worker at `max_outstanding` or one whose `max_input_len` is below the request
(Arlo policies handle that themselves), while a worker's TTL has run out but the sweep has
not removed it yet, and every error case. One difference for aladdin/caraserve: the time-
based estimates of a view (tokens generated so far) are as of its last refresh, where the
scan computes them at the dispatch.

What a request is placed with (`request_view`): the SLOs of the deployment it is for
(`Deployment.ttft_slo_ms` / `atgt_slo_ms`; `DispatcherSettings.ttft_slo_ms` / `atgt_slo_ms`
override them when > 0) and its predicted output clamped to its `max_tokens` (when > 0).
"""
from __future__ import annotations

import functools
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from polyserve.core.names import MODEL_POLICIES
from polyserve.dispatcher import index as dindex
from polyserve.dispatcher import policy, policy_aladdin, prefer
from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.live import ModelBook
from polyserve.dispatcher.registry import Outstanding, WorkerRegistry
from polyserve.dispatcher.views import Decision, PolicyState, RequestView, WorkerView
from polyserve.proto import (
    Completed,
    Deployment,
    Dispatched,
    DispatchRequest,
    Failed,
    FirstToken,
    Heartbeat,
    WorkerDown,
)
from polyserve.shared.bus import BusError

logger = logging.getLogger(__name__)
_NO_STATE = PolicyState()
ENDED_REMEMBERED = 10_000  # ended request ids kept against late `dispatched` events


class Choice(NamedTuple):
    """A decision and what recording and answering it need."""

    decision: Decision
    worker: Heartbeat  # the chosen worker's last heartbeat
    request: RequestView  # what the policy was given
    candidates: int  # workers the policy chose among
    indexed: bool = False  # the fast twin over the index answered (not the scan)
    prefixed: bool = False  # one of `DispatchRequest.prefer` (the gateway's hint: prefer.py)


class _DepIndex:
    """One deployment's `WorkerIndex` and what tells whether it may answer a request."""

    def __init__(self, dep: Deployment, key: tuple, cap: int):
        self.key = key  # (policy, TTFT SLO, ATGT SLO) it was built for
        self.modelled = dep.policy in MODEL_POLICIES
        self.arlo = dep.policy.startswith("arlo")
        self.fast = dindex.FAST_POLICIES[dep.policy]
        # aladdin's structure is per SLO pair: built at the first decision, for the deployment's
        # (model policies: a placement appends the request to the view's `requests` as the
        # model book does, see `LiveView._placed_in_index`)
        self.index = dindex.WorkerIndex(policies=() if dep.policy == "aladdin" else (dep.policy,),
                                        track_requests=self.modelled)
        self.cap = cap
        self.capped: set[str] = set()  # workers at max_outstanding
        self.limits: dict[str, int] = {}  # worker -> max_input_len, when > 0
        self._min_limit: float | None = math.inf  # None: recompute

    def upsert(self, v: WorkerView) -> None:
        wid = v.worker_id
        self.index.upsert(v)
        if self.cap > 0 and v.outstanding >= self.cap:
            self.capped.add(wid)
        else:
            self.capped.discard(wid)
        if self.limits.get(wid, 0) != v.max_input_len:
            if v.max_input_len > 0:
                self.limits[wid] = v.max_input_len
            else:
                self.limits.pop(wid, None)
            self._min_limit = None

    def placed(self, wid: str, request: RequestView, entry=None) -> None:
        """`request` was placed on `wid`: outstanding + 1 (and, modelled, it joins `requests`)."""
        self.index.placed(wid, request, entry)
        if self.cap > 0 and self.index.load(wid)[0] >= self.cap:
            self.capped.add(wid)

    def remove(self, wid: str) -> None:
        self.index.remove(wid)
        self.capped.discard(wid)
        if self.limits.pop(wid, None) is not None:
            self._min_limit = None

    def answers(self, input_tokens: int) -> bool:
        """Whether the fast policy gives the scan's decision for a request without `exclude`."""
        if not len(self.index) or self.capped:
            return False
        if self.arlo:  # the levels logic: the same decision as over the workers that fit, when one does
            return self.index._struct("arlo").lengths[-1] >= input_tokens
        if self._min_limit is None:
            self._min_limit = min(self.limits.values(), default=math.inf)
        return input_tokens <= self._min_limit


def _settled(method: Callable) -> Callable:
    """Run `LiveView.settle` before `method`: every event sees the placements answered before
    it as recorded (`LiveView.record_later`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._later:
            self.settle()
        return method(self, *args, **kwargs)

    return run


class LiveView:
    """Workers, placements, the model book and the per-deployment indexes (module docstring).

    A placement may be recorded after its reply is sent (`record_later`, then `settle`):
    the handler answers with the decision alone, and the bookkeeping (outstanding count,
    model book, index update: about half of a dispatch's CPU time for aladdin/caraserve)
    runs once the reply is on its way. Correctness does not depend on when that happens:
    `decide` and every event method settle the queue first, so nothing reads a state
    that lacks an answered placement (asyncio runs one handler at a time)."""

    def __init__(self, settings: DispatcherSettings, rng: random.Random | None = None, *,
                 registry: WorkerRegistry | None = None, outstanding: Outstanding | None = None,
                 models: ModelBook | None = None):
        self.settings = settings
        if rng is None:
            rng = random.Random(settings.seed) if settings.seed >= 0 else random.Random()
        self.rng = rng
        # (`is None`, not `or`: an empty registry or Outstanding is falsy)
        self.registry = WorkerRegistry() if registry is None else registry
        self.outstanding = (Outstanding(settings.max_tracked, settings.placement_ttl_s)
                            if outstanding is None else outstanding)
        self.models = (ModelBook(settings.max_tracked, signal_interval_s=settings.scale_signal_interval_s)
                       if models is None else models)
        self.policy_state: dict[str, PolicyState] = {}
        self.placed = 0
        self.indexed_decisions = 0
        self._model_deps: set[str] = set()  # deployments placed with a model policy (for re-balancing)
        self._indexes: dict[str, _DepIndex] = {}  # deployment -> its index (settings.index)
        self._indexed_in: dict[str, str] = {}  # worker -> the deployment whose index holds it
        self._dirty: set[str] = set()  # workers whose view changed since the last refresh
        self.shared = 0  # placements counted from other replicas' `dispatched` events
        # request ids recently ended, so a late `dispatched` of one does not count it again
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._later: list[tuple[Deployment, Choice]] = []  # answered, not yet recorded (in order)
        if settings.index:
            self.outstanding.on_change = self._dirty.add

    # ---------------------------------------------------------------- decisions
    def slos(self, dep: Deployment) -> tuple[float, float]:
        """(TTFT, ATGT) SLOs in ms the deployment's requests are placed against."""
        s = self.settings
        return (s.ttft_slo_ms if s.ttft_slo_ms > 0 else dep.ttft_slo_ms,
                s.atgt_slo_ms if s.atgt_slo_ms > 0 else dep.atgt_slo_ms)

    def request_view(self, dep: Deployment, req: DispatchRequest,
                     slos: tuple[float, float] | None = None) -> RequestView:
        """What the policy sees of `req`: the deployment's SLOs, the prediction within `max_tokens`."""
        ttft, atgt = self.slos(dep) if slos is None else slos
        cap = max(0, req.max_tokens)
        predicted = min(req.predicted_tokens, cap) if cap else req.predicted_tokens
        return RequestView(request_id=req.request_id, input_tokens=req.input_tokens, predicted_tokens=predicted,
                           length_class=req.length_class, adapter=req.adapter, priority=req.priority,
                           adapter_rank=req.adapter_rank, ttft_slo_ms=ttft, atgt_slo_ms=atgt, max_tokens=cap)

    def decide(self, dep: Deployment, req: DispatchRequest) -> Choice:
        """The deployment's policy over its live workers: the index's fast twin when it gives
        the scan's answer, else the scan (BusError 503/429 when no worker may take `req`;
        UnknownPolicy for a deployment whose policy is not in `POLICIES`)."""
        if self._later:  # the placements answered before this one count
            self.settle()
        choose = policy.get_policy(dep.policy)
        slos = self.slos(dep)
        rview = self.request_view(dep, req, slos)
        state = self.policy_state.get(dep.id, _NO_STATE)
        di = self._index_for(dep, slos) if self.settings.index else None
        if di is not None and not req.exclude and di.answers(req.input_tokens) \
                and not self.registry.any_expired():
            decision = di.fast(di.index, rview, state, self.rng)
            self.indexed_decisions += 1
            choice = Choice(decision, self.registry.get(decision.worker_id), rview, len(di.index), True)
        else:
            workers, beats = self.candidates(dep, req)
            decision = choose(workers, rview, state, self.rng)
            choice = Choice(decision, beats[decision.worker_id], rview, len(workers))
        if not req.prefer:
            return choice
        return prefer.keep(self, dep, req, choice, state, di.index if choice.indexed else None)

    def record(self, dep: Deployment, choice: Choice) -> None:
        """Account the placement `choice` (outstanding, policy state, model book, index)."""
        if self._later:
            self.settle()
        self._record(dep, choice)

    def record_later(self, dep: Deployment, choice: Choice) -> bool:
        """Queue `record(dep, choice)` until `settle` (class docstring); True when the queue
        was empty, i.e. the caller should arrange for `settle` to run."""
        self._later.append((dep, choice))
        return len(self._later) == 1

    def settle(self) -> None:
        """Record the queued placements (`record_later`), in the order they were decided (one
        at most: a decision settles the queue first)."""
        while self._later:
            dep, choice = self._later.pop(0)  # (taken off first: one that fails is not retried)
            self._record(dep, choice)

    def _record(self, dep: Deployment, choice: Choice) -> None:
        wid = choice.worker.worker_id
        self.policy_state[dep.id] = choice.decision.state
        self.outstanding.place(choice.request.request_id, wid)
        self._ended.pop(choice.request.request_id, None)  # (a retry of a request that had failed)
        self.placed += 1
        entry = None
        if dep.policy in MODEL_POLICIES:
            entry = self.models.placed(wid, choice.request)
            self._model_deps.add(dep.id)
            self._dirty.add(wid)
        self._placed_in_index(dep, wid, choice.request, entry)
        self._refresh()

    def _placed_in_index(self, dep: Deployment, wid: str, request: RequestView, entry=None) -> None:
        """Update the chosen worker's indexed view in place of rebuilding it: outstanding + 1
        and, for aladdin/caraserve, the request appended to `requests` as the book's newest
        (not yet started) entry — what a rebuild gives but for the time-based estimates of its
        other requests, which stay as of its last refresh (module docstring). A rebuild from
        the book costs O(its requests) and a new RunningRequest each; this, one entry. When
        the counts do not match one placement more (a retry of a request already on that
        worker), the worker stays marked for the full rebuild."""
        di = self._indexes.get(dep.id)
        if di is None or self._indexed_in.get(wid) != dep.id:
            return
        load = di.index.load(wid)  # (outstanding, requests) without building the view
        if load is None or self.outstanding.count(wid) != load[0] + 1:
            return
        if di.modelled and self.models.requests.tracked(wid) != load[1] + 1:
            return
        di.placed(wid, request, entry)  # (the book's entry: the same `as_new(request)`)
        self._dirty.discard(wid)

    def views(self, beats: Iterable[Heartbeat], modelled: bool) -> list[WorkerView]:
        """Fresh views of the workers (with their book entries and fits when `modelled`)."""
        if not modelled:
            return [_view(h, self.outstanding.count(h.worker_id)) for h in beats]
        now = self.models.clock()
        return [_view(h, self.outstanding.count(h.worker_id), self.models.extras(h, now)) for h in beats]

    def candidates(self, dep: Deployment, req: DispatchRequest) -> tuple[list[WorkerView], dict[str, Heartbeat]]:
        """Live workers of the deployment that may take `req` (views and heartbeats by id),
        or a BusError saying why there is none."""
        live = self.registry.live(dep.id)
        excluded = set(req.exclude)
        allowed = [h for h in live if h.worker_id not in excluded]
        fits = [h for h in allowed if h.max_input_len <= 0 or req.input_tokens <= h.max_input_len]
        views = self.views(fits, dep.policy in MODEL_POLICIES)
        cap = self.settings.max_outstanding
        free = [v for v in views if cap <= 0 or v.outstanding < cap]
        if free:
            return free, {h.worker_id: h for h in fits}
        if views:
            raise BusError(429, f"all {len(views)} workers of deployment {dep.id!r} have "
                                f"{cap} outstanding requests (max_outstanding); retry later")
        known = self.registry.known(dep.id)
        if known == 0:
            raise BusError(503, f"no worker available for deployment {dep.id!r}: none is running; "
                                "start one (the planner and gpu-agent do) and retry")
        why = []
        if len(live) < known:
            why.append(f"{known - len(live)} not heard from within their heartbeat TTL")
        if len(allowed) < len(live):
            why.append(f"{len(live) - len(allowed)} excluded by the caller")
        if len(fits) < len(allowed):
            why.append(f"{len(allowed) - len(fits)} with max_input_len below the request's "
                       f"{req.input_tokens} input tokens")
        raise BusError(503, f"no worker available for deployment {dep.id!r} ({known} registered: "
                            f"{', '.join(why)}); retry later")

    # ---------------------------------------------------------------- Alg. 2
    @_settled
    def model_deployments(self) -> list[str]:
        """Deployments this dispatcher placed on with a model policy."""
        return sorted(self._model_deps)

    @_settled
    def rebalance_plan(self, dep: Deployment, max_moves: int) -> list[tuple[policy_aladdin.Move, Heartbeat]]:
        """Aladdin Alg. 2 over the deployment's live workers: the moves (each with its
        destination's heartbeat) from under- to over-estimated workers."""
        beats = {h.worker_id: h for h in self.registry.live(dep.id)}
        if len(beats) < 2:
            return []
        views = self.views(beats.values(), True)
        if not any(not r.started for v in views for r in v.requests):
            return []
        ttft, atgt = self.slos(dep)
        cfg = policy_aladdin.config_for(RequestView(ttft_slo_ms=ttft, atgt_slo_ms=atgt))
        return [(mv, beats[mv.dst]) for mv in policy_aladdin.rebalance(views, cfg, max_moves=max_moves)]

    @_settled
    def moved(self, mv: policy_aladdin.Move) -> None:
        """The source worker gave the request back: it now waits on `mv.dst`."""
        self.models.moved(mv.request_id, mv.dst)
        self.outstanding.place(mv.request_id, mv.dst)
        self.models.moves += 1
        self._dirty.update((mv.src, mv.dst))
        self._refresh()

    # ---------------------------------------------------------------- events
    @_settled
    def seed(self, beats: Iterable[Heartbeat]) -> int:
        """Workers registered in Redis at start (those not live already); how many were added."""
        n = 0
        for hb in beats:
            if hb.worker_id not in {w.worker_id for w in self.registry.live(hb.deployment)} \
                    and self.registry.heartbeat(hb, seeded=True):
                self._dirty.add(hb.worker_id)
                n += 1
        self._refresh()
        return n

    @_settled
    def heartbeat(self, hb: Heartbeat) -> bool:
        """A worker's heartbeat; False when it predates that worker's WorkerDown (ignored)."""
        if not self.registry.heartbeat(hb):
            return False
        self._dirty.add(hb.worker_id)
        self._refresh()
        return True

    @_settled
    def worker_down(self, ev: WorkerDown) -> tuple[bool, int]:
        """Stop placing on a worker at once; (whether it was live, placements dropped)."""
        known = self.registry.down(ev)
        dropped = self.outstanding.forget_worker(ev.worker_id)
        self.models.forget_worker(ev.worker_id)
        self._dirty.add(ev.worker_id)
        self._refresh()
        return known, dropped

    @_settled
    def dispatched(self, ev: Dispatched) -> bool:
        """A placement announced by the gateway (`dispatched` event): one made by another
        dispatcher replica, by the gateway's local fallback, or a migration, counts as
        outstanding on its worker here too, so every replica sees the whole load. This
        replica's own placements are already counted (deduplicated by request_id); a request
        that already ended (its `completed` overtook the event) is not counted again. Only the
        outstanding count is shared: the model book (aladdin/caraserve) keeps this replica's
        placements alone, as the event does not carry the request's lengths; a tracked request
        announced on another worker moves there. Whether the count changed."""
        if not ev.request_id or not ev.worker_id or ev.request_id in self._ended:
            return False
        if self.outstanding.worker_of(ev.request_id) == ev.worker_id:
            return False
        self.outstanding.place(ev.request_id, ev.worker_id)
        if self.models.moved(ev.request_id, ev.worker_id):
            self._dirty.add(ev.worker_id)
        self.shared += 1
        self._dirty.add(ev.worker_id)
        self._refresh()
        return True

    @_settled
    def finished(self, ev: Completed | Failed) -> None:
        """A request ended: it no longer counts against its worker; its timings refit the
        worker's models (aladdin/caraserve)."""
        self._ended[ev.request_id] = None
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self.outstanding.finish(ev.request_id)
        self.models.finished(ev)
        self._dirty.add(ev.worker_id)
        self._refresh()

    @_settled
    def first_token(self, ev: FirstToken) -> None:
        """A request started decoding (its worker's book entry becomes ongoing)."""
        self.models.first_token(ev)
        self._dirty.add(ev.worker_id)
        self._refresh()

    @_settled
    def sweep(self) -> None:
        """Forget expired workers and placements (memory bound; dispatch also checks TTLs itself)."""
        for wid in self.registry.sweep():
            logger.info("worker %s expired: no heartbeat within its TTL", wid)
            self._dirty.add(wid)
        if n := self.outstanding.expire():
            logger.warning("%d placements expired without a completed/failed event", n)
        for di in self._indexes.values():  # time-based estimates (tokens so far) go stale
            if di.modelled:
                self._dirty.update(v.worker_id for v in di.index.views() if any(r.started for r in v.requests))
        self._refresh()

    # ---------------------------------------------------------------- the indexes
    def _index_for(self, dep: Deployment, slos: tuple[float, float]) -> _DepIndex:
        """The deployment's index: built from the registry at its first dispatch, rebuilt
        when its policy or its SLOs change."""
        di = self._indexes.get(dep.id)
        if di is not None and di.key[0] == dep.policy and di.key[1:] == slos:
            return di
        key = (dep.policy, *slos)
        if di is not None:
            del self._indexes[dep.id]
            for v in di.index.views():
                self._indexed_in.pop(v.worker_id, None)
        self._refresh()
        di = self._indexes[dep.id] = _DepIndex(dep, key, self.settings.max_outstanding)
        now = self.models.clock()
        for hb in self.registry.of(dep.id):
            self._upsert(di, hb, now)
        return di

    def _upsert(self, di: _DepIndex, hb: Heartbeat, now: float) -> None:
        wid = hb.worker_id
        extras = self.models.extras(hb, now) if di.modelled else None
        di.upsert(_view(hb, self.outstanding.count(wid), extras))
        self._indexed_in[wid] = hb.deployment

    def _refresh(self) -> None:
        """Rebuild the views of the workers marked dirty in their deployment's index; a
        worker no longer in the registry (or now in another deployment) leaves it."""
        if not self._indexes:
            self._dirty.clear()
            return
        workers = list(self._dirty)
        self._dirty.clear()
        now = None
        for wid in workers:
            hb = self.registry.get(wid)
            dep = self._indexed_in.get(wid)
            if dep is not None and (hb is None or hb.deployment != dep):
                del self._indexed_in[wid]
                if dep in self._indexes:
                    self._indexes[dep].remove(wid)
            if hb is None:
                continue
            di = self._indexes.get(hb.deployment)
            if di is not None:
                if now is None:
                    now = self.models.clock()
                self._upsert(di, hb, now)


def _view(hb: Heartbeat, outstanding: int, extras: dict | None = None) -> WorkerView:
    return WorkerView(worker_id=hb.worker_id, outstanding=outstanding, running=hb.running,
                      waiting=hb.waiting, kv_used=hb.kv_used, kv_capacity=hb.kv_capacity,
                      max_input_len=hb.max_input_len, gpu_id=hb.gpu_id,
                      adapters=tuple(a.name for a in hb.adapters), **(extras or {}))
