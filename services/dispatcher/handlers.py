"""The `polyserve.v1.dispatch` handler, the event listeners and Alg. 2 re-balancing, over
the dispatcher's state (`liveview.LiveView`: workers, placements, model book, indexes).

A dispatch is one straight path: look the deployment up (cached, with a timeout: Redis is
read only for deployments, and by the service to seed the worker view at start), let the
view decide, record the placement in the view, answer — for aladdin/caraserve the recording
comes right after the reply is sent (`LiveView.record_later` / `settle`: off the reply's
path, never missed by the next read). The handlers get what they need
passed in — the view, the deployment cache, the subjects, the bus's `publish` (and
`ask` for a re-balancing round) — and hold no state of their own but counters.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from polyserve.core.names import MODEL_POLICIES, PREFERRED
from polyserve.dispatcher import policy
from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.liveview import LiveView
from polyserve.dispatcher.policy_aladdin import Move
from polyserve.dispatcher.registry import DeploymentCache
from polyserve.proto import (
    Completed,
    Deployment,
    Dispatched,
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


class DispatchHandlers:
    """`polyserve.v1.dispatch`, the worker/request event listeners and re-balancing."""

    def __init__(self, settings: DispatcherSettings, view: LiveView, deployments: DeploymentCache,
                 subjects: Subjects, publish: Publish | None = None,
                 on_model_policy: Callable[[], Awaitable[None]] | None = None):
        self.settings = settings
        self.view = view
        self.deployments = deployments
        self.subjects = subjects
        self.publish = publish
        # run once, at this replica's first aladdin/caraserve placement, before its reply
        # (service.py: that is when `first_token` events start to matter here)
        self.on_model_policy = on_model_policy
        self.rejected: dict[int, int] = {}  # by status code

    # ---------------------------------------------------------------- dispatch
    async def dispatch(self, req: DispatchRequest) -> Placement:
        """Choose a worker for `req` with its deployment's policy."""
        try:
            return await self._dispatch(req)
        except BusError as exc:
            self.rejected[exc.code] = self.rejected.get(exc.code, 0) + 1
            raise

    async def _dispatch(self, req: DispatchRequest) -> Placement:
        dep = await self._deployment(req)
        if dep.policy in MODEL_POLICIES and self.on_model_policy is not None:
            hook, self.on_model_policy = self.on_model_policy, None
            await hook()
        choice = self.view.decide(dep, req)
        if dep.policy not in MODEL_POLICIES:
            self.view.record(dep, choice)  # cheap (~6-11 µs): deferring it costs more CPU than it saves
        elif self.view.record_later(dep, choice):
            # aladdin/caraserve: the bookkeeping (model book, index update: ~20-40 µs) runs
            # after this reply is sent (`LiveView.settle`): the bus publishes the reply once
            # this returns, and the NATS client's flusher task, which writes it to the
            # socket, is woken by that publish; a second `call_soon` hop queues `settle`
            # behind it. Whatever runs first (another dispatch, an event) settles the queue
            # itself, so the state is never read without it.
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self.view.settle)
        if choice.decision.scale_out and dep.policy in MODEL_POLICIES:
            await self._signal(dep, req.request_id, choice.candidates)
        logger.debug("dispatch %s -> %s (deployment %s, policy %s, %d candidates%s)", req.request_id,
                     choice.worker.worker_id, dep.id, dep.policy, choice.candidates,
                     ", indexed" if choice.indexed else "")
        name = dep.policy + PREFERRED if choice.prefixed else dep.policy
        return self._placement(req.request_id, choice.worker, name, req.priority)

    async def _deployment(self, req: DispatchRequest) -> Deployment:
        """The deployment `req` is for, or a BusError (400 bad request, 404 unknown, 500 bad policy)."""
        if not req.deployment:
            raise BusError(400, "deployment must be a non-empty deployment id")
        if req.input_tokens < 0:
            raise BusError(400, f"input_tokens must be >= 0, got {req.input_tokens}")
        dep = await self.deployments.get(req.deployment)
        if dep is None:
            raise BusError(404, f"unknown deployment {req.deployment!r}; create it with POST /v1/deployments")
        if dep.policy not in policy.POLICIES:
            raise BusError(500, f"deployment {dep.id!r} is misconfigured: {policy.UnknownPolicy(dep.policy)}; "
                                "re-create it with POST /v1/deployments")
        return dep

    def _placement(self, request_id: str, hb: Heartbeat, policy_name: str, priority: int = 0) -> Placement:
        return Placement(request_id=request_id, worker_id=hb.worker_id,
                         generate_subject=hb.generate_subject or self.subjects.generate(hb.worker_id),
                         cancel_subject=hb.cancel_subject or self.subjects.cancel(hb.worker_id),
                         policy=policy_name, priority=priority)

    async def _signal(self, dep: Deployment, request_id: str, workers: int) -> None:
        """Ask the planner for one more worker (rate-limited per deployment)."""
        if self.publish is None or not self.view.models.should_signal(dep.id):
            return
        why = (f"{dep.policy}: none of {workers} workers meets the SLO constraints for request {request_id}; "
               "placed on the least loaded")
        logger.info("scale signal for %s: %s", dep.id, why)
        try:
            await self.publish(self.subjects.scale_signal(dep.id), ScaleSignal(
                deployment=dep.id, source=dep.policy, reason=why, request_id=request_id))
        except Exception as exc:  # best effort: the placement stands
            logger.warning("cannot publish the scale signal for %s: %s", dep.id, exc)

    # ---------------------------------------------------------------- events
    async def on_heartbeat(self, hb: Heartbeat) -> None:
        """Refresh a worker's entry in the live view."""
        if not self.view.heartbeat(hb):
            logger.debug("ignoring heartbeat of %s older than its worker_down", hb.worker_id)

    async def on_worker_down(self, ev: WorkerDown) -> None:
        """Stop placing on a worker at once; its placements stop counting."""
        known, dropped = self.view.worker_down(ev)
        logger.info("worker %s down (%s)%s; %d outstanding placements dropped", ev.worker_id, ev.reason,
                    "" if known else " [was not live]", dropped)

    async def on_dispatched(self, ev: Dispatched) -> None:
        """A placement the gateway announced: counted here too when another replica (or the
        gateway's fallback, or a migration) made it, so replicas share the load they see."""
        if self.view.dispatched(ev):
            logger.debug("dispatched %s -> %s counted from the event (policy %s)", ev.request_id, ev.worker_id,
                         ev.policy)

    async def on_finished(self, ev: Completed | Failed) -> None:
        """A request ended: it no longer counts against its worker; its timings refit the
        worker's models (aladdin/caraserve)."""
        self.view.finished(ev)

    async def on_first_token(self, ev: FirstToken) -> None:
        """A request started decoding (its worker's book entry becomes ongoing)."""
        self.view.first_token(ev)

    # ---------------------------------------------------------------- Alg. 2
    async def rebalance(self, ask: Ask) -> int:
        """One round of Aladdin Alg. 2 over each aladdin deployment: move not-yet-started
        requests from under- to over-estimated workers. `ask(subject, Withdraw)` asks the
        source worker to give the request back; a request that started meanwhile stays.
        Returns the number of requests moved."""
        moved = 0
        for dep_id in self.view.model_deployments():
            dep = self.deployments.cached(dep_id)
            if dep is None or dep.policy != "aladdin":
                continue
            for mv, dst in self.view.rebalance_plan(dep, self.settings.rebalance_max_moves):
                if await self._withdraw(mv, self._placement(mv.request_id, dst, dep.policy), ask):
                    self.view.moved(mv)
                    moved += 1
                    logger.info("moved %s from %s to %s (Aladdin Alg. 2)", mv.request_id, mv.src, mv.dst)
        return moved

    async def _withdraw(self, mv: Move, target: Placement, ask: Ask) -> bool:
        """Whether the source worker gave the request back (redirected to `target`)."""
        try:
            reply = await ask(self.subjects.withdraw(mv.src), Withdraw(request_id=mv.request_id, placement=target))
        except Exception as exc:  # an old worker without withdraw, or gone: leave it
            logger.debug("withdraw %s from %s failed: %s", mv.request_id, mv.src, exc)
            return False
        return reply.withdrawn
