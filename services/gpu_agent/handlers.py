"""Bus handlers of the gpu-agent: start and stop workers, follow their heartbeats.

Handlers validate at the edge and always reply: a caller's mistake is a
BusError with a 4xx code, a failure to spawn a 500 that says why.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from polyserve.gpu_agent import policy
from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.energy import EnergyMeter
from polyserve.gpu_agent.workers import WorkerPool
from polyserve.proto import AgentReply, Completed, Heartbeat, Refused, StartWorker, StopWorker
from polyserve.shared.bus import BusError

logger = logging.getLogger(__name__)


class AgentHandlers:
    """Request handlers of one agent. They get what they act on: the settings, the worker
    pool, the energy meter, how to spawn a worker on this GPU and how to refresh AgentInfo."""

    def __init__(self, settings: GpuAgentSettings, pool: WorkerPool, energy: EnergyMeter, *,
                 spawn: Callable[[StartWorker], str], publish_info: Callable[[], Awaitable[None]],
                 gpu_id: Callable[[], str], publish_refusal: Callable[[Refused], Awaitable[None]] | None = None):
        self.settings, self.pool, self.energy = settings, pool, energy
        self.spawn, self.publish_info, self.gpu_id = spawn, publish_info, gpu_id
        self.publish_refusal = publish_refusal
        self.refused = 0

    async def start(self, req: StartWorker) -> AgentReply:
        """StartWorker -> AgentReply.started: spawn `count` workers (as many as fit)."""
        for name in ("deployment", "model", "engine"):
            if not getattr(req, name).strip():
                raise BusError(400, f"StartWorker.{name} must not be empty")
        await self._check_env(req)
        if req.count < 1:
            raise BusError(400, f"StartWorker.count must be >= 1, got {req.count}")
        running = len(self.pool.active())
        free = self.settings.max_workers - running
        if free <= 0:
            raise BusError(409, f"gpu-agent {self.gpu_id()} already runs {running} workers "
                                f"(max_workers={self.settings.max_workers})")
        if req.count > free:
            logger.warning("asked for %d workers of %s, room for %d; starting %d",
                           req.count, req.deployment, free, free)
        started: list[str] = []
        try:
            for _ in range(min(req.count, free)):
                started.append(self.spawn(req))
        except OSError as exc:
            logger.exception("cannot start a worker for %s", req.deployment)
            if not started:
                raise BusError(500, f"cannot start worker process: {exc}") from exc
        finally:
            if started:  # before replying, so the planner's next count includes them
                await self.publish_info()
        return AgentReply(gpu_id=self.gpu_id(), started=started)

    async def _check_env(self, req: StartWorker) -> None:
        """BusError 400 naming the refused `extra_env` keys (never their values), after a
        Refused event, when the request may not set them (policy.check_extra_env)."""
        refused = policy.check_extra_env(req.extra_env, self.settings.extra_env_allowed())
        if not refused:
            return
        self.refused += 1
        reason = "; ".join(f"{k}: {why}" for k, why in refused)
        logger.warning("refused StartWorker for %s: extra_env %s", req.deployment, reason)
        if self.publish_refusal is not None:
            try:
                await self.publish_refusal(Refused(service="gpu-agent", instance=self.settings.instance,
                                                   action="start_worker", reason=reason[:500],
                                                   keys=[k for k, _ in refused], deployment=req.deployment))
            except Exception as exc:  # noqa: BLE001 - the refusal stands even if the event is lost
                logger.warning("cannot publish the refusal event: %s", exc)
        raise BusError(400, f"StartWorker.extra_env refused: {reason}")

    async def stop(self, req: StopWorker) -> AgentReply:
        """StopWorker -> AgentReply.stopped: SIGTERM now, SIGKILL after the drain timeout."""
        if req.worker_id is None and req.count < 1:
            raise BusError(400, f"StopWorker.count must be >= 1, got {req.count}")
        if req.worker_id is None and not req.deployment:
            raise BusError(400, "StopWorker needs a deployment or a worker_id")
        victims = policy.choose_victims([w.view() for w in self.pool.workers.values()], req.deployment,
                                        req.count, self.pool.load, req.worker_id)
        if req.worker_id is not None and not victims:
            raise BusError(404, f"worker {req.worker_id} is not running on gpu-agent {self.gpu_id()}")
        stopped = self.pool.stop(victims, self.settings.drain_timeout_s)
        if stopped:
            await self.publish_info()
        return AgentReply(gpu_id=self.gpu_id(), stopped=stopped)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        """Keep the load of this agent's own workers (least-busy stops, simulated utilisation)."""
        self.pool.record_load(hb.worker_id, hb.running, hb.waiting)

    async def on_completed(self, ev: Completed) -> None:
        """A request one of this agent's workers completed: it shares the window's energy."""
        if ev.worker_id in self.pool.workers:
            self.energy.add(ev)
