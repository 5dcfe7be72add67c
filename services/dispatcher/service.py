"""The dispatcher service: `polyserve.v1.dispatch` over a live view of workers."""
from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

from polyserve.dispatcher import native
from polyserve.dispatcher.config import DispatcherSettings, tune_gc
from polyserve.dispatcher.handlers import DispatchHandlers
from polyserve.dispatcher.liveview import LiveView
from polyserve.dispatcher.registry import DeploymentCache
from polyserve.proto import (
    Completed,
    Dispatched,
    DispatchRequest,
    Failed,
    FirstToken,
    Heartbeat,
    Keys,
    WithdrawReply,
    WorkerDown,
)
from polyserve.shared.lifecycle import ServiceBase

logger = logging.getLogger(__name__)

QUEUE = "dispatcher"
FITS_EVERY_S = 5.0


class DispatcherService(ServiceBase):
    """Places requests on workers with the deployment's policy (`policy.POLICIES`); its
    state is one `LiveView`, its NATS handlers `DispatchHandlers` over it."""

    name = "dispatcher"
    settings: DispatcherSettings

    def __init__(self, settings: DispatcherSettings, **kw: Any):
        super().__init__(settings, **kw)
        self.view = LiveView(settings)
        self.handlers: DispatchHandlers = None  # type: ignore[assignment]  # set in on_start

    def tune_process(self) -> None:
        before = tune_gc(self.settings)
        logger.info("dispatcher: garbage-collection thresholds %s -> %s (gc_gen0)", before, gc.get_threshold())

    async def on_start(self) -> None:
        """Listen to worker and request events, seed the worker view from Redis, then serve."""
        s = self.settings
        logger.info("dispatcher: %s", native.describe())  # which build decides (compiled or pure Python)
        deployments = DeploymentCache(self.state, ttl_s=s.deployment_cache_s, timeout_s=s.redis_timeout_s,
                                      retry_s=s.redis_retry_s)
        self.handlers = h = DispatchHandlers(s, self.view, deployments, self.subjects, publish=self.bus.publish,
                                             on_model_policy=self._follow_first_tokens)
        # Events first, so nothing between the Redis seed and serving is missed.
        # No queue group: every dispatcher needs every heartbeat and every outcome.
        await self.bus.listen(self.subjects.worker_event("heartbeat"), Heartbeat, h.on_heartbeat)
        await self.bus.listen(self.subjects.worker_event("down"), WorkerDown, h.on_worker_down)
        # Every placement, whichever replica (or the gateway's fallback) made it: replicas in
        # the queue group count each other's, so each sees the whole load (`LiveView.dispatched`).
        await self.bus.listen(self.subjects.event("dispatched"), Dispatched, h.on_dispatched)
        await self.bus.listen(self.subjects.event("completed"), Completed, h.on_finished)
        await self.bus.listen(self.subjects.event("failed"), Failed, h.on_finished)
        await self._seed()
        await self.bus.serve(self.subjects.dispatch, DispatchRequest, h.dispatch, queue=QUEUE)
        self.background(self._sweep_loop(), "sweep")
        self.background(self._fits_loop(), "fits")
        if s.rebalance_s > 0:
            self.background(self._rebalance_loop(), "rebalance")

    async def _follow_first_tokens(self) -> None:
        """Listen to `first_token` from now on. It only moves an aladdin/caraserve book entry of
        this replica's own placements (`LiveView.first_token`), so a dispatcher starts listening
        at its first such placement: one delivery and an index refresh per request fewer while
        it serves load-only policies (issue 15; the gateway places those itself). The SUB goes
        out on this connection before the placement's reply, so nats-server has it before the
        gateway can publish that request's `first_token`."""
        await self.bus.listen(self.subjects.event("first_token"), FirstToken, self.handlers.on_first_token)

    async def _seed(self) -> None:
        """Start from the workers registered in Redis; heartbeats take over from there."""
        try:
            beats = await asyncio.wait_for(self.state.live_workers(), max(1.0, self.settings.redis_timeout_s))
        except Exception as exc:  # Redis down at start: heartbeats will fill the view within one period
            logger.warning("dispatcher: cannot read live workers from Redis (%s: %s); waiting for heartbeats",
                           type(exc).__name__, exc)
            return
        logger.info("dispatcher: seeded %d live workers from Redis", self.view.seed(beats))

    async def _sweep_loop(self) -> None:
        while not self.stop_event.is_set():
            await asyncio.sleep(self.settings.sweep_s)
            try:
                self.view.sweep()
            except Exception:
                logger.exception("dispatcher: sweep failed")

    async def _fits_loop(self) -> None:
        """Every 5 s, each worker's fitted models and their error, for `polyserve status`."""
        keys = Keys(self.settings.prefix)
        while not self.stop_event.is_set():
            await asyncio.sleep(FITS_EVERY_S)
            for wid, rep in self.view.models.report().items():
                try:
                    await self.state.put_json(keys.perf_fit(wid), rep, ttl=6 * FITS_EVERY_S)
                except Exception as exc:  # Redis down: the next round retries
                    logger.debug("cannot store the fit of %s: %s", wid, exc)
                    break

    async def _rebalance_loop(self) -> None:
        async def ask(subject, msg):
            return await self.bus.request(subject, msg, WithdrawReply, timeout=0.5, span_name="withdraw")

        while not self.stop_event.is_set():
            await asyncio.sleep(self.settings.rebalance_s)
            try:
                await self.handlers.rebalance(ask)
            except Exception:
                logger.exception("dispatcher: re-balancing failed")
