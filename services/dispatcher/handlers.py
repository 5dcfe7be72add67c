"""Dispatcher state and handlers: the live worker view, the outstanding-request
accounting, the deployment cache, and the `polyserve.v1.dispatch` handler.

All of it is in memory and bounded; Redis is read only for deployments (cached,
with a timeout) and to seed the worker view at start.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from polyserve.dispatcher import policy, policy_aladdin
from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.live import MODEL_POLICIES, ModelBook
from polyserve.proto import (Completed, Deployment, DispatchRequest, Failed, FirstToken, Heartbeat, Placement,
                             ScaleSignal, Subjects, Withdraw, WithdrawReply, WorkerDown)
from polyserve.shared.bus import BusError
from polyserve.shared.state import State

logger = logging.getLogger(__name__)
Clock = Callable[[], float]
Publish = Callable[[str, object], Awaitable[None]]
Ask = Callable[[str, Withdraw], Awaitable[WithdrawReply]]

TOMBSTONE_S = 60.0  # how long a WorkerDown keeps older, late heartbeats from reviving a worker


@dataclass
class _Live:
    hb: Heartbeat
    expires: float  # monotonic


class WorkerRegistry:
    """Workers heard from recently: added by heartbeats, expired after their `ttl_s`,
    removed at once by WorkerDown."""

    def __init__(self, clock: Clock = time.monotonic, wall: Clock = time.time):
        self.clock = clock
        self.wall = wall
        self._workers: dict[str, _Live] = {}
        self._down: dict[str, tuple[float, float]] = {}  # worker_id -> (down event ts, forget at)

    def heartbeat(self, hb: Heartbeat, *, seeded: bool = False) -> bool:
        """Record a heartbeat; False when it predates a WorkerDown of that worker.

        A live heartbeat counts from its arrival (immune to clock skew between
        hosts); one seeded from Redis counts from its own timestamp.
        """
        down = self._down.get(hb.worker_id)
        if down is not None:
            if hb.ts <= down[0]:
                return False
            del self._down[hb.worker_id]
        ttl = hb.ttl_s if not seeded else max(0.0, hb.ts + hb.ttl_s - self.wall())
        self._workers[hb.worker_id] = _Live(hb, self.clock() + ttl)
        return True

    def down(self, ev: WorkerDown) -> bool:
        """Remove a worker at once; True when it was known."""
        self._down[ev.worker_id] = (ev.ts, self.clock() + TOMBSTONE_S)
        return self._workers.pop(ev.worker_id, None) is not None

    def live(self, deployment: str) -> list[Heartbeat]:
        """Last heartbeats of the deployment's workers whose TTL has not run out."""
        now = self.clock()
        return [w.hb for w in self._workers.values() if w.hb.deployment == deployment and w.expires > now]

    def known(self, deployment: str) -> int:
        """Workers of the deployment still in memory, expired or not."""
        return sum(1 for w in self._workers.values() if w.hb.deployment == deployment)

    def sweep(self) -> list[str]:
        """Forget expired workers and old tombstones; return the expired worker ids."""
        now = self.clock()
        gone = [wid for wid, w in self._workers.items() if w.expires <= now]
        for wid in gone:
            del self._workers[wid]
        for wid in [wid for wid, (_, until) in self._down.items() if until <= now]:
            del self._down[wid]
        return gone

    def __len__(self) -> int:
        return len(self._workers)


class Outstanding:
    """request_id -> worker of this dispatcher's placements, until a completed/failed
    event; bounded (`max_tracked`) and expiring (`ttl_s`) so leaks cannot grow."""

    def __init__(self, max_tracked: int, ttl_s: float, clock: Clock = time.monotonic):
        self.max_tracked = max_tracked
        self.ttl_s = ttl_s
        self.clock = clock
        self._placed: OrderedDict[str, tuple[str, float]] = OrderedDict()  # oldest first
        self._per_worker: dict[str, int] = {}
        self.expired = 0
        self.evicted = 0

    def place(self, request_id: str, worker_id: str) -> None:
        """Count a placement (a retry of the same request moves it to the new worker)."""
        self.finish(request_id)
        self._placed[request_id] = (worker_id, self.clock() + self.ttl_s)
        self._per_worker[worker_id] = self._per_worker.get(worker_id, 0) + 1
        while len(self._placed) > self.max_tracked:
            self._drop_oldest()
            self.evicted += 1

    def finish(self, request_id: str) -> str | None:
        """Stop counting a request; its worker, or None when it was not tracked."""
        entry = self._placed.pop(request_id, None)
        if entry is None:
            return None
        self._dec(entry[0])
        return entry[0]

    def forget_worker(self, worker_id: str) -> int:
        """Drop every placement on a worker that is gone; how many were dropped."""
        ids = [rid for rid, (wid, _) in self._placed.items() if wid == worker_id]
        for rid in ids:
            self.finish(rid)
        return len(ids)

    def expire(self) -> int:
        """Drop placements older than the TTL; how many were dropped."""
        now, n = self.clock(), 0
        while self._placed and next(iter(self._placed.values()))[1] <= now:
            self._drop_oldest()
            n += 1
        self.expired += n
        return n

    def count(self, worker_id: str) -> int:
        return self._per_worker.get(worker_id, 0)

    def __len__(self) -> int:
        return len(self._placed)

    def _drop_oldest(self) -> None:
        _, (wid, _) = self._placed.popitem(last=False)
        self._dec(wid)

    def _dec(self, worker_id: str) -> None:
        n = self._per_worker.get(worker_id, 0) - 1
        if n > 0:
            self._per_worker[worker_id] = n
        else:
            self._per_worker.pop(worker_id, None)


class DeploymentCache:
    """Deployments read from Redis, each reused for `ttl_s`; when Redis fails the
    cached copy keeps serving (stale) and Redis is left alone for `retry_s`."""

    MAX_ENTRIES = 4096

    def __init__(self, state: State, *, ttl_s: float, timeout_s: float, retry_s: float,
                 clock: Clock = time.monotonic):
        self.state = state
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self._cache: OrderedDict[str, tuple[Deployment, float]] = OrderedDict()
        self._down_until = 0.0
        self.redis_errors = 0

    def cached(self, dep_id: str) -> Deployment | None:
        """The cached copy, however old (no Redis call)."""
        entry = self._cache.get(dep_id)
        return entry[0] if entry is not None else None

    async def get(self, dep_id: str) -> Deployment | None:
        """The deployment, or None when Redis says it does not exist.

        Raises BusError(503) only when Redis is unavailable and the deployment
        was never cached.
        """
        now = self.clock()
        cached = self._cache.get(dep_id)
        if cached is not None and now - cached[1] < self.ttl_s:
            return cached[0]
        if now >= self._down_until:
            try:
                dep = await asyncio.wait_for(self.state.get_deployment(dep_id), self.timeout_s)
            except Exception as exc:  # timeout, connection refused: serve from the cache
                self.redis_errors += 1
                self._down_until = self.clock() + self.retry_s
                logger.warning("dispatcher: cannot read deployment %r from Redis (%s: %s)%s", dep_id,
                               type(exc).__name__, exc, "; using the cached copy" if cached else "")
            else:
                if dep is None:
                    self._cache.pop(dep_id, None)
                    return None
                self._cache[dep_id] = (dep, self.clock())
                self._cache.move_to_end(dep_id)
                while len(self._cache) > self.MAX_ENTRIES:
                    self._cache.popitem(last=False)
                return dep
        if cached is not None:
            return cached[0]
        raise BusError(503, f"deployment registry (Redis) unavailable and deployment {dep_id!r} "
                            "is not cached; retry shortly")


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
        workers, beats = self._candidates(dep, req, modelled)
        state = self.policy_state.get(dep.id, policy.PolicyState())
        rview = _request_view(req, self.settings)
        decision = choose(workers, rview, state, self.rng)
        self.policy_state[dep.id] = decision.state
        hb = beats[decision.worker_id]
        self.outstanding.place(req.request_id, hb.worker_id)
        self.placed += 1
        if modelled:
            self.models.placed(hb.worker_id, rview)
            self._model_deps.add(dep.id)
            if decision.scale_out:
                await self._signal(dep, req.request_id, len(workers))
        logger.debug("dispatch %s -> %s (deployment %s, policy %s, %d candidates)",
                     req.request_id, hb.worker_id, dep.id, dep.policy, len(workers))
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

    async def on_worker_down(self, ev: WorkerDown) -> None:
        """Stop placing on a worker at once; its placements stop counting."""
        known = self.registry.down(ev)
        dropped = self.outstanding.forget_worker(ev.worker_id)
        self.models.forget_worker(ev.worker_id)
        logger.info("worker %s down (%s)%s; %d outstanding placements dropped", ev.worker_id, ev.reason,
                    "" if known else " [was not live]", dropped)

    async def on_finished(self, ev: Completed | Failed) -> None:
        """A request ended: it no longer counts against its worker; its timings refit the
        worker's models (aladdin/caraserve)."""
        self.outstanding.finish(ev.request_id)
        self.models.finished(ev)

    async def on_first_token(self, ev: FirstToken) -> None:
        """A request started decoding (its worker's book entry becomes ongoing)."""
        self.models.first_token(ev)

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
                    self.models.moves += 1
                    moved += 1
                    logger.info("moved %s from %s to %s (Aladdin Alg. 2)", mv.request_id, mv.src, mv.dst)
        return moved

    def sweep(self) -> None:
        """Forget expired workers and placements (memory bound; dispatch also checks TTLs itself)."""
        for wid in self.registry.sweep():
            logger.info("worker %s expired: no heartbeat within its TTL", wid)
        if n := self.outstanding.expire():
            logger.warning("%d placements expired without a completed/failed event", n)


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
