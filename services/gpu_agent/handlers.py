"""Bus handlers of the gpu-agent: start and stop workers, follow their heartbeats.

Handlers validate at the edge and always reply: a caller's mistake is a
BusError with a 4xx code, a failure to spawn a 500 that says why.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from polyserve.gpu_agent import policy
from polyserve.proto import AgentReply, Completed, Heartbeat, StartWorker, StopWorker
from polyserve.shared.bus import BusError

if TYPE_CHECKING:
    from polyserve.gpu_agent.service import GpuAgentService

logger = logging.getLogger(__name__)


class AgentHandlers:
    """Request handlers bound to one agent."""

    def __init__(self, agent: "GpuAgentService"):
        self.agent = agent

    async def start(self, req: StartWorker) -> AgentReply:
        """StartWorker -> AgentReply.started: spawn `count` workers (as many as fit)."""
        agent = self.agent
        for name in ("deployment", "model", "engine"):
            if not getattr(req, name).strip():
                raise BusError(400, f"StartWorker.{name} must not be empty")
        if req.count < 1:
            raise BusError(400, f"StartWorker.count must be >= 1, got {req.count}")
        running = sum(1 for w in agent.workers.values() if not w.stopping)
        free = agent.settings.max_workers - running
        if free <= 0:
            raise BusError(409, f"gpu-agent {agent.gpu_id} already runs {running} workers "
                                f"(max_workers={agent.settings.max_workers})")
        if req.count > free:
            logger.warning("asked for %d workers of %s, room for %d; starting %d",
                           req.count, req.deployment, free, free)
        started: list[str] = []
        try:
            for _ in range(min(req.count, free)):
                started.append(agent.spawn_worker(req))
        except OSError as exc:
            logger.exception("cannot start a worker for %s", req.deployment)
            if not started:
                raise BusError(500, f"cannot start worker process: {exc}") from exc
        finally:
            if started:  # before replying, so the planner's next count includes them
                await agent.publish_info()
        return AgentReply(gpu_id=agent.gpu_id, started=started)

    async def stop(self, req: StopWorker) -> AgentReply:
        """StopWorker -> AgentReply.stopped: SIGTERM now, SIGKILL after the drain timeout."""
        agent = self.agent
        if req.worker_id is None and req.count < 1:
            raise BusError(400, f"StopWorker.count must be >= 1, got {req.count}")
        if req.worker_id is None and not req.deployment:
            raise BusError(400, "StopWorker needs a deployment or a worker_id")
        victims = policy.choose_victims([w.view() for w in agent.workers.values()], req.deployment,
                                        req.count, agent.load, req.worker_id)
        if req.worker_id is not None and not victims:
            raise BusError(404, f"worker {req.worker_id} is not running on gpu-agent {agent.gpu_id}")
        stopped = agent.stop_workers(victims, agent.settings.drain_timeout_s)
        if stopped:
            await agent.publish_info()
        return AgentReply(gpu_id=agent.gpu_id, stopped=stopped)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        """Keep the load of this agent's own workers (least-busy stops, simulated utilisation)."""
        if hb.worker_id in self.agent.workers:
            self.agent.load[hb.worker_id] = max(0, hb.running) + max(0, hb.waiting)

    async def on_completed(self, ev: Completed) -> None:
        """A request one of this agent's workers completed: it shares the window's energy."""
        if ev.worker_id in self.agent.workers:
            self.agent.energy.add(ev)
