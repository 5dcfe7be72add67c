"""The planner: the per-token-latency autoscaler (thesis §5–§6) as a reconcile loop.

Every `poll_interval_s` (and once at start), for each deployment in Redis:
count its workers across the live gpu-agents (AgentInfo, which lists a process
from the moment it is spawned, so nothing is started twice), compute the
windowed metric from `completed` events, decide with `policy.decide`, publish
the `ScaleDecision` (event + Redis plan) and actuate through the agents:
StartWorker on the agents with the fewest workers, StopWorker on the agents
hosting the most workers of the deployment. With `actuator=kubernetes` the count
and the action are the replicas of the deployment's Kubernetes Deployment instead
(`k8s.KubernetesActuator`; pods created but not yet running count as pending).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from opentelemetry.sdk.trace.export import SpanExporter

from polyserve.planner import policy
from polyserve.planner.config import PlannerSettings
from polyserve.planner.handlers import PlannerHandlers
from polyserve.proto import (AgentInfo, AgentReply, Completed, Deployment, Heartbeat, ScaleDecision,
                             StartWorker, StopWorker, WorkerDown)
from polyserve.shared.bus import BusError
from polyserve.shared.lifecycle import ServiceBase

logger = logging.getLogger(__name__)

NO_AGENT = "no gpu-agent available"


class PlannerService(ServiceBase):
    """Autoscales deployments from the latency their requests see."""

    name = "planner"

    def __init__(self, settings: PlannerSettings, *, span_exporter: SpanExporter | None = None):
        super().__init__(settings, span_exporter=span_exporter)
        self.settings: PlannerSettings = settings
        self.windows: dict[str, policy.Window] = {}
        self.history: dict[str, deque[tuple[float, int]]] = {}  # recommendations, for stabilisation
        self.last_change: dict[str, float] = {}  # deployment -> time of the last scaling action
        self.heartbeats: dict[str, float] = {}  # worker_id -> time of its last heartbeat
        self.live_workers: list[Heartbeat] = []  # from Redis, each tick in Kubernetes mode
        self.first_seen: dict[str, float] = {}  # worker_id -> when an AgentInfo first listed it
        self.decisions: dict[str, ScaleDecision] = {}
        self.handlers = PlannerHandlers(self)
        self._lock = asyncio.Lock()
        self.k8s = None  # k8s.KubernetesActuator with actuator=kubernetes (set at start, or by tests)

    # ------------------------------------------------------------------ lifecycle
    async def on_start(self) -> None:
        s = self.settings
        if s.actuator == "kubernetes" and self.k8s is None:
            from polyserve.planner.k8s import KubernetesActuator

            try:
                import kubernetes  # noqa: F401
            except ImportError as exc:
                raise RuntimeError("actuator=kubernetes needs the `kubernetes` package "
                                   "(pip install 'polyserve[k8s]')") from exc
            self.k8s = await asyncio.to_thread(
                KubernetesActuator.from_config, s.k8s_namespace, in_cluster=s.k8s_in_cluster,
                kubeconfig=s.k8s_kubeconfig or None, name_template=s.k8s_name_template,
                timeout_s=s.request_timeout_s)
        await self.bus.listen(self.subjects.event("completed"), Completed, self.handlers.on_completed)
        await self.bus.listen(self.subjects.worker_event("heartbeat"), Heartbeat, self.handlers.on_heartbeat)
        await self.bus.listen(self.subjects.worker_event("down"), WorkerDown, self.handlers.on_worker_down)
        self.background(self._poll_loop(), "poll")

    async def on_drain(self, timeout: float) -> None:
        """Let a reconcile in progress finish (its agent requests are bounded by timeouts)."""
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
            self._lock.release()
        except asyncio.TimeoutError:
            logger.warning("a reconcile still runs after %.1fs; it will be cancelled", timeout)

    async def _poll_loop(self) -> None:
        while True:  # the first round runs at once, so `polyserve up` gets its first worker fast
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - Redis/NATS briefly down: next poll retries
                logger.warning("reconcile failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.settings.poll_interval_s)

    # ------------------------------------------------------------------ reconcile
    def sample_count(self, deployment: str) -> int:
        """Samples held for `deployment` (all of them, not only the current window)."""
        window = self.windows.get(deployment)
        return len(window) if window is not None else 0

    async def tick(self) -> list[ScaleDecision]:
        """One reconcile over every deployment; returns the published decisions."""
        async with self._lock:
            deployments = await self.state.list_deployments()
            agents = await self.state.live_agents()
            if self.k8s is not None:
                self.live_workers = await self.state.live_workers()
            now = time.time()
            self._track_workers(agents, now)
            known = {d.id for d in deployments}
            for table in (self.windows, self.history, self.last_change, self.decisions):
                for dep_id in [d for d in table if d not in known]:
                    del table[dep_id]  # bounded memory: deleted deployments, events for unknown ones
            decisions = []
            for dep in deployments:
                try:
                    decisions.append(await self._reconcile(dep, agents, now))
                except Exception:  # noqa: BLE001 - one deployment must not stop the others
                    logger.exception("reconcile of deployment %s failed", dep.id)
            if self.settings.stop_orphans:
                await self._stop_orphans(known, agents)
            return decisions

    def _track_workers(self, agents: list[AgentInfo], now: float) -> None:
        listed = {w for a in agents for w in a.workers}
        for wid in listed:
            self.first_seen.setdefault(wid, now)
        for wid in [w for w in self.first_seen if w not in listed]:
            del self.first_seen[wid]
        stale = now - max(600.0, 10 * self.settings.poll_interval_s)
        for wid in [w for w, t in self.heartbeats.items() if t < stale and w not in listed]:
            del self.heartbeats[wid]

    def _pending(self, worker_ids: list[str], now: float) -> int:
        """Workers started recently that have not heartbeated yet."""
        grace = self.settings.worker_start_grace_s
        return sum(1 for w in worker_ids
                   if w not in self.heartbeats and now - self.first_seen.get(w, now) < grace)

    async def _reconcile(self, dep: Deployment, agents: list[AgentInfo], now: float) -> ScaleDecision:
        s = self.settings
        scaler = dep.scaler
        hosting = {a.gpu_id: [w for w, d in a.workers.items() if d == dep.id] for a in agents}
        current = sum(len(ws) for ws in hosting.values())
        if self.k8s is not None:
            replicas = await asyncio.to_thread(self.k8s.replicas, dep.id)
            hosting, current = {}, replicas.desired
        t0 = now - scaler.window_s
        if s.reset_window_on_scale and dep.id in self.last_change:
            t0 = max(t0, self.last_change[dep.id])
        window = self.windows.get(dep.id)
        if window is not None:
            window.prune(now - scaler.window_s)
        samples = window.since(t0) if window is not None else []
        history = self.history.setdefault(dep.id, deque(maxlen=1024))
        while history and history[0][0] < now - s.scale_down_stabilization_s:
            history.popleft()
        pending = self._pending([w for ws in hosting.values() for w in ws], now)
        if self.k8s is not None and now - self.last_change.get(dep.id, 0.0) < s.worker_start_grace_s:
            pending = max(0, replicas.desired - self._serving(dep.id))  # pods not serving yet
        decision = policy.decide(current, samples, scaler, now=now, history=list(history),
                                 stabilization_s=s.scale_down_stabilization_s, pending=pending,
                                 max_step=s.max_step, tolerance=s.tolerance)
        history.append((now, decision.recommended))
        reason = decision.reason
        if decision.desired != current:
            if self.k8s is not None:
                reason += await self._actuate_k8s(dep, decision.desired)
            elif not agents:
                reason = f"{NO_AGENT}; {reason}"
                logger.warning("deployment %s wants %d workers, has %d: %s",
                               dep.id, decision.desired, current, NO_AGENT)
            else:
                reason += await self._actuate(dep, agents, hosting, current, decision.desired)
        msg = ScaleDecision(deployment=dep.id, scaler=scaler.type, current=current,
                            desired=decision.desired, metric_ms=decision.metric_ms,
                            threshold_ms=scaler.threshold_ms, samples=decision.samples, reason=reason)
        self.decisions[dep.id] = msg
        await self.bus.publish(self.subjects.scale(dep.id), msg)
        await self.state.put_plan(msg)
        if decision.desired != current:
            logger.info("scale %s: %d -> %d (%s)", dep.id, current, decision.desired, reason)
        return msg

    async def _actuate(self, dep: Deployment, agents: list[AgentInfo], hosting: dict[str, list[str]],
                       current: int, desired: int) -> str:
        """Ask the agents to start or stop workers; returns a note for the decision's reason."""
        changed, failures = 0, []
        if desired > current:
            plan = policy.plan_starts({a.gpu_id: len(a.workers) for a in agents}, desired - current)
            for gpu_id, count in plan.items():
                req = StartWorker(deployment=dep.id, model=dep.model, engine=dep.engine, count=count)
                reply = await self._ask(gpu_id, "start", req, failures)
                changed += len(reply.started) if reply else 0
            note = f"; started {changed}"
        else:
            plan = policy.plan_stops({g: len(ws) for g, ws in hosting.items()}, current - desired)
            for gpu_id, count in plan.items():
                reply = await self._ask(gpu_id, "stop", StopWorker(deployment=dep.id, count=count), failures)
                changed += len(reply.stopped) if reply else 0
            note = f"; stopped {changed}"
        if changed:
            self.last_change[dep.id] = time.time()
        return note + (f"; failed: {'; '.join(failures)}" if failures else "")

    def _serving(self, dep_id: str) -> int:
        """Workers of `dep_id` with a live heartbeat in Redis (Kubernetes mode: the pods' workers)."""
        return sum(1 for hb in self.live_workers if hb.deployment == dep_id)

    async def _actuate_k8s(self, dep: Deployment, desired: int) -> str:
        from polyserve.planner.k8s import ActuatorError

        try:
            got = await asyncio.to_thread(self.k8s.scale, dep.id, desired)
        except ActuatorError as exc:
            logger.warning("kubernetes refused to scale %s: %s", dep.id, exc)
            return f"; kubernetes failed: {exc}"
        self.last_change[dep.id] = time.time()
        return f"; kubernetes replicas -> {got}"

    async def _ask(self, gpu_id: str, action: str, req: StartWorker | StopWorker,
                   failures: list[str]) -> AgentReply | None:
        try:
            return await self.bus.request(self.subjects.agent(gpu_id, action), req, AgentReply,
                                          timeout=self.settings.request_timeout_s)
        except BusError as exc:
            logger.warning("gpu-agent %s refused %s for %s: %s", gpu_id, action, req.deployment, exc)
            failures.append(f"{gpu_id} {action}: {exc.description}")
            return None

    async def _stop_orphans(self, known: set[str], agents: list[AgentInfo]) -> None:
        """Stop workers whose deployment was deleted."""
        for agent in agents:
            orphans: dict[str, int] = {}
            for dep_id in agent.workers.values():
                if dep_id not in known:
                    orphans[dep_id] = orphans.get(dep_id, 0) + 1
            for dep_id, count in orphans.items():
                logger.info("deployment %s is gone; stopping its %d worker(s) on %s", dep_id, count, agent.gpu_id)
                await self._ask(agent.gpu_id, "stop", StopWorker(deployment=dep_id, count=count), [])
