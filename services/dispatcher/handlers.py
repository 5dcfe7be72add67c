"""The `polyserve.v1.dispatch` handler and the event listeners over the dispatcher's state
(the live worker view, outstanding placements and deployment cache are in `registry`).

All of it is in memory and bounded; Redis is read only for deployments (cached,
with a timeout) and to seed the worker view at start.

With `index` on (the default; `POLYSERVE_DISPATCHER_INDEX=false` turns it off) each
deployment's workers are also kept in a `dispatcher.index.WorkerIndex`: a worker's view is
rebuilt and upserted whenever something it is made of changes — its heartbeat, this
dispatcher's outstanding count for it (placements, completed/failed, expiry), and for
aladdin/caraserve its `ModelBook` entries and fit (placement, first_token, completed/
failed, moves; the sweep refreshes them every `sweep_s` as well) — and the policy's fast
twin answers in O(log n) instead of a scan over freshly built views. The scan still
answers, over the filtered list exactly as before, a request with `exclude`, a deployment
with a worker at `max_outstanding` or one whose `max_input_len` is below the request
(Arlo policies handle that themselves), while a worker's TTL has run out but the sweep has
not removed it yet, and every error case. One difference for aladdin/caraserve: the time-
based estimates of a view (tokens generated so far) are as of its last refresh, where the
scan computes them at the dispatch.
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable

from polyserve.dispatcher import index as dindex
from polyserve.dispatcher import policy, policy_aladdin
from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.live import MODEL_POLICIES, ModelBook
from polyserve.dispatcher.registry import DeploymentCache, Outstanding, WorkerRegistry
from polyserve.proto import (
    Completed,
    Deployment,
    DispatchRequest,
    Failed,
    FirstToken,
    Heartbeat,
    Placement,
    ScaleSignal,
    Subjects,
    Withdraw,
    WithdrawReply,
    WorkerDown,
)
from polyserve.shared.bus import BusError

logger = logging.getLogger(__name__)
Publish = Callable[[str, object], Awaitable[None]]
Ask = Callable[[str, Withdraw], Awaitable[WithdrawReply]]


class _DepIndex:
    """One deployment's `WorkerIndex` and what tells whether it may answer a request."""

    def __init__(self, policy_name: str, cap: int):
        self.policy = policy_name
        self.modelled = policy_name in MODEL_POLICIES
        self.arlo = policy_name.startswith("arlo")
        self.fast = dindex.FAST_POLICIES[policy_name]
        self.index = dindex.WorkerIndex(policies=(policy_name,), track_requests=False)
        self.cap = cap
        self.capped: set[str] = set()  # workers at max_outstanding
        self.limits: dict[str, int] = {}  # worker -> max_input_len, when > 0
        self._min_limit: float | None = math.inf  # None: recompute

    def upsert(self, v: policy.WorkerView) -> None:
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


class DispatchHandlers:
    """`polyserve.v1.dispatch` and the worker/request event listeners."""

    def __init__(self, settings: DispatcherSettings, subjects: Subjects, deployments: DeploymentCache,
                 registry: WorkerRegistry, outstanding: Outstanding, rng: random.Random,
                 publish: Publish | None = None, models: ModelBook | None = None):
        self.settings = settings
        self.subjects = subjects
        self.deployments = deployments
        self.registry = registry
        self.outstanding = outstanding
        self.rng = rng
        self.publish = publish
        self.models = models or ModelBook(settings.max_tracked, signal_interval_s=settings.scale_signal_interval_s)
        self.policy_state: dict[str, policy.PolicyState] = {}
        self.placed = 0
        self.rejected: dict[int, int] = {}  # by status code
        self._model_deps: set[str] = set()  # deployments placed with a model policy (for re-balancing)
        self._indexes: dict[str, _DepIndex] = {}  # deployment -> its index (settings.index)
        self._indexed_in: dict[str, str] = {}  # worker -> the deployment whose index holds it
        self._dirty: set[str] = set()  # workers whose view changed since the last refresh
        self.indexed_decisions = 0
        if settings.index:
            outstanding.on_change = self._dirty.add

    # ---------------------------------------------------------------- dispatch
    async def dispatch(self, req: DispatchRequest) -> Placement:
        """Choose a worker for `req` with its deployment's policy."""
        try:
            return await self._dispatch(req)
        except BusError as exc:
            self.rejected[exc.code] = self.rejected.get(exc.code, 0) + 1
            raise

    async def _dispatch(self, req: DispatchRequest) -> Placement:
        if not req.deployment:
            raise BusError(400, "deployment must be a non-empty deployment id")
        if req.input_tokens < 0:
            raise BusError(400, f"input_tokens must be >= 0, got {req.input_tokens}")
        dep = await self.deployments.get(req.deployment)
        if dep is None:
            raise BusError(404, f"unknown deployment {req.deployment!r}; create it with POST /v1/deployments")
        try:
            choose = policy.get_policy(dep.policy)
        except policy.UnknownPolicy as exc:
            raise BusError(500, f"deployment {dep.id!r} is misconfigured: {exc}; "
                                "re-create it with POST /v1/deployments") from None
        modelled = dep.policy in MODEL_POLICIES
        state = self.policy_state.get(dep.id, policy.PolicyState())
        rview = _request_view(req, self.settings)
        di = self._index_for(dep, choose) if self.settings.index else None
        if di is not None and not req.exclude and di.answers(req.input_tokens) \
                and not self.registry.any_expired():
            decision = di.fast(di.index, rview, state, self.rng)
            n_workers = len(di.index)
            hb = self.registry.get(decision.worker_id)
            self.indexed_decisions += 1
        else:  # the scan over the filtered list (and every error case)
            workers, beats = self._candidates(dep, req, modelled)
            decision = choose(workers, rview, state, self.rng)
            n_workers = len(workers)
            hb = beats[decision.worker_id]
        self.policy_state[dep.id] = decision.state
        self.outstanding.place(req.request_id, hb.worker_id)
        self.placed += 1
        if modelled:
            self.models.placed(hb.worker_id, rview)
            self._model_deps.add(dep.id)
            self._dirty.add(hb.worker_id)
        self._refresh()
        if modelled and decision.scale_out:
            await self._signal(dep, req.request_id, n_workers)
        logger.debug("dispatch %s -> %s (deployment %s, policy %s, %d candidates)",
                     req.request_id, hb.worker_id, dep.id, dep.policy, n_workers)
        return Placement(request_id=req.request_id, worker_id=hb.worker_id,
                         generate_subject=hb.generate_subject or self.subjects.generate(hb.worker_id),
                         cancel_subject=hb.cancel_subject or self.subjects.cancel(hb.worker_id),
                         policy=dep.policy, priority=req.priority)

    async def _signal(self, dep: Deployment, request_id: str, workers: int) -> None:
        """Ask the planner for one more worker (rate-limited per deployment)."""
        if self.publish is None or not self.models.should_signal(dep.id):
            return
        why = (f"{dep.policy}: none of {workers} workers meets the SLO constraints for request {request_id}; "
               "placed on the least loaded")
        logger.info("scale signal for %s: %s", dep.id, why)
        try:
            await self.publish(self.subjects.scale_signal(dep.id), ScaleSignal(
                deployment=dep.id, source=dep.policy, reason=why, request_id=request_id))
        except Exception as exc:  # best effort: the placement stands
            logger.warning("cannot publish the scale signal for %s: %s", dep.id, exc)

    # ---------------------------------------------------------------- the index
    def _index_for(self, dep: Deployment, choose) -> _DepIndex | None:
        """The deployment's index (built from the registry at its first dispatch, rebuilt
        when its policy changes); None when its policy has no fast twin."""
        di = self._indexes.get(dep.id)
        if di is not None and di.policy == dep.policy:
            return di
        if di is not None:  # the deployment's policy changed
            del self._indexes[dep.id]
            for v in di.index.views():
                self._indexed_in.pop(v.worker_id, None)
        if dindex.PURE_POLICIES.get(dep.policy) is not choose:
            return None  # a policy registered without an indexed twin
        self._refresh()
        di = self._indexes[dep.id] = _DepIndex(dep.policy, self.settings.max_outstanding)
        now = self.models.clock()
        for hb in self.registry.of(dep.id):
            self._upsert(di, hb, now)
        return di

    def _upsert(self, di: _DepIndex, hb: Heartbeat, now: float) -> None:
        wid = hb.worker_id
        extras = self.models.extras(hb, now) if di.modelled else None
        di.upsert(_view(hb, self.outstanding.count(wid), extras))
        self._indexed_in[wid] = hb.deployment

    def _refresh(self, workers=None) -> None:
        """Rebuild the views of the workers marked dirty (or `workers`) in their deployment's
        index; a worker no longer in the registry leaves it."""
        if not self._indexes:
            self._dirty.clear()
            return
        if workers is None:
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

    def _views(self, beats: list[Heartbeat], modelled: bool) -> list[policy.WorkerView]:
        if not modelled:
            return [_view(h, self.outstanding.count(h.worker_id)) for h in beats]
        now = self.models.clock()
        return [_view(h, self.outstanding.count(h.worker_id), self.models.extras(h, now)) for h in beats]

    def _candidates(self, dep: Deployment, req: DispatchRequest,
                    modelled: bool = False) -> tuple[list[policy.WorkerView], dict[str, Heartbeat]]:
        """Live workers of the deployment that may take `req` (views and heartbeats by id),
        or a BusError saying why there is none."""
        live = self.registry.live(dep.id)
        excluded = set(req.exclude)
        allowed = [h for h in live if h.worker_id not in excluded]
        fits = [h for h in allowed if h.max_input_len <= 0 or req.input_tokens <= h.max_input_len]
        views = self._views(fits, modelled)
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

    # ---------------------------------------------------------------- events
    async def on_heartbeat(self, hb: Heartbeat) -> None:
        """Refresh a worker's entry in the live view."""
        if not self.registry.heartbeat(hb):
            logger.debug("ignoring heartbeat of %s older than its worker_down", hb.worker_id)
            return
        self._dirty.add(hb.worker_id)
        self._refresh()

    async def on_worker_down(self, ev: WorkerDown) -> None:
        """Stop placing on a worker at once; its placements stop counting."""
        known = self.registry.down(ev)
        dropped = self.outstanding.forget_worker(ev.worker_id)
        self.models.forget_worker(ev.worker_id)
        self._dirty.add(ev.worker_id)
        self._refresh()
        logger.info("worker %s down (%s)%s; %d outstanding placements dropped", ev.worker_id, ev.reason,
                    "" if known else " [was not live]", dropped)

    async def on_finished(self, ev: Completed | Failed) -> None:
        """A request ended: it no longer counts against its worker; its timings refit the
        worker's models (aladdin/caraserve)."""
        self.outstanding.finish(ev.request_id)
        self.models.finished(ev)
        self._dirty.add(ev.worker_id)
        self._refresh()

    async def on_first_token(self, ev: FirstToken) -> None:
        """A request started decoding (its worker's book entry becomes ongoing)."""
        self.models.first_token(ev)
        self._dirty.add(ev.worker_id)
        self._refresh()

    # ---------------------------------------------------------------- Alg. 2
    async def rebalance(self, ask: Ask) -> int:
        """One round of Aladdin Alg. 2 over each aladdin deployment: move not-yet-started
        requests from under- to over-estimated workers. `ask(subject, Withdraw)` asks the
        source worker to give the request back; a request that started meanwhile stays.
        Returns the number of requests moved."""
        moved = 0
        for dep_id in list(self._model_deps):
            dep = self.deployments.cached(dep_id)
            if dep is None or dep.policy != "aladdin":
                continue
            beats = {h.worker_id: h for h in self.registry.live(dep_id)}
            if len(beats) < 2:
                continue
            views = self._views(list(beats.values()), True)
            if not any(not r.started for v in views for r in v.requests):
                continue
            cfg = policy_aladdin.config_for(_request_view(DispatchRequest(
                request_id="", deployment=dep_id, model=dep.model, input_tokens=0), self.settings))
            for mv in policy_aladdin.rebalance(views, cfg, max_moves=self.settings.rebalance_max_moves):
                dst = beats[mv.dst]
                target = Placement(request_id=mv.request_id, worker_id=dst.worker_id,
                                   generate_subject=dst.generate_subject or self.subjects.generate(dst.worker_id),
                                   cancel_subject=dst.cancel_subject or self.subjects.cancel(dst.worker_id),
                                   policy=dep.policy)
                try:
                    reply = await ask(self.subjects.withdraw(mv.src), Withdraw(request_id=mv.request_id,
                                                                                placement=target))
                except Exception as exc:  # an old worker without withdraw, or gone: leave it
                    logger.debug("withdraw %s from %s failed: %s", mv.request_id, mv.src, exc)
                    continue
                if reply.withdrawn:
                    self.models.moved(mv.request_id, mv.dst)
                    self.outstanding.place(mv.request_id, mv.dst)
                    self._dirty.update((mv.src, mv.dst))
                    self._refresh()
                    self.models.moves += 1
                    moved += 1
                    logger.info("moved %s from %s to %s (Aladdin Alg. 2)", mv.request_id, mv.src, mv.dst)
        return moved

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


def _view(hb: Heartbeat, outstanding: int, extras: dict | None = None) -> policy.WorkerView:
    return policy.WorkerView(worker_id=hb.worker_id, outstanding=outstanding, running=hb.running,
                             waiting=hb.waiting, kv_used=hb.kv_used, kv_capacity=hb.kv_capacity,
                             max_input_len=hb.max_input_len, gpu_id=hb.gpu_id,
                             adapters=tuple(a.name for a in hb.adapters), **(extras or {}))


def _request_view(req: DispatchRequest, settings: DispatcherSettings | None = None) -> policy.RequestView:
    return policy.RequestView(request_id=req.request_id, input_tokens=req.input_tokens,
                              predicted_tokens=req.predicted_tokens, length_class=req.length_class,
                              adapter=req.adapter, priority=req.priority, adapter_rank=req.adapter_rank,
                              ttft_slo_ms=settings.ttft_slo_ms if settings else 0.0,
                              atgt_slo_ms=settings.atgt_slo_ms if settings else 0.0)
