"""The planner: the autoscalers (thesis §5–§6 HPA, Arlo target tracking, signal-driven
Aladdin/CaraServe/µ-Serve) as a reconcile loop.

Every `poll_interval_s` (and once at start), for each deployment in Redis:
count its workers across the live gpu-agents (AgentInfo, which lists a process
from the moment it is spawned, so nothing is started twice) and how many are still
starting, take the samples of its window from `completed` events and the workers'
loads from their heartbeats, and step the deployment's `autoscalers.Autoscaler`
(`autoscalers.from_policy`: the same objects the simulator steps; their state lives
in `state.PlannerState`). Then publish the `ScaleDecision` (event + Redis plan) and
actuate through the agents: StartWorker on the agents with the fewest workers,
StopWorker on the agents hosting the most workers of the deployment (each stops its
least busy). With `actuator=kubernetes` the count and the action are the replicas
of the deployment's Kubernetes Deployment instead (`k8s.KubernetesActuator`; pods
created but not yet running count as pending).

Scale signals: `ScaleSignal`s (dispatcher: Aladdin/CaraServe found no feasible
worker; gpu-agent: MIAD at max clock still missing) grow a deployment whose scaler
type is signal-driven by one worker each (`policy.signal_decision`: cooldown,
starting workers pending, max_replicas), published as a `ScaleDecision` like any
other. Other scaler types ignore them.

Arlo: every `arlo_period_s` the runtimes of `encoder` deployments are re-planned
(`arlo_replan.ArloReplanner`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
from opentelemetry.sdk.trace.export import SpanExporter

from polyserve.core.names import canonical_scaler
from polyserve.planner import arlo_live, autoscalers, policy
from polyserve.planner.arlo_replan import NO_AGENT, ArloReplanner
from polyserve.planner.autoscalers import Observation, WorkerLoad
from polyserve.planner.config import PlannerSettings
from polyserve.planner.handlers import PlannerHandlers
from polyserve.planner.reconcile import EPOCH_KEY, DesiredStateKeeper, OrphanTracker, check_epoch
from polyserve.planner.state import PlannerState
from polyserve.proto import (
    AgentInfo,
    AgentReply,
    Completed,
    Deployment,
    Heartbeat,
    RuntimePlan,
    ScaleDecision,
    ScaleSignal,
    StartWorker,
    StopWorker,
    WorkerDown,
)
from polyserve.shared.bus import BusError
from polyserve.shared.lifecycle import ServiceBase

logger = logging.getLogger(__name__)

__all__ = ["NO_AGENT", "PlannerService"]


@dataclass(frozen=True)
class Count:
    """A deployment's workers as the actuator sees them."""

    hosting: dict[str, list[str]]  # gpu_id -> worker ids (empty with Kubernetes)
    current: int
    pending: int  # started, not serving yet
    workers: list[WorkerLoad]  # the serving ones with their outstanding work


class PlannerService(ServiceBase):
    """Autoscales deployments from the latency their requests see."""

    name = "planner"

    def __init__(self, settings: PlannerSettings, *, span_exporter: SpanExporter | None = None):
        super().__init__(settings, span_exporter=span_exporter)
        self.settings: PlannerSettings = settings
        self.memory = PlannerState(max_samples=settings.max_samples)
        self.handlers = PlannerHandlers(self.memory, self.handle_signal)
        self._lock = asyncio.Lock()
        self.k8s = None  # k8s.KubernetesActuator with actuator=kubernetes (set at start, or by tests)
        self.arlo: ArloReplanner | None = None  # set at start (it needs the bus and Redis)
        self.orphans = OrphanTracker(grace_s=settings.orphan_grace_s)
        self.epoch: str | None = None  # the Redis epoch token (reconcile.check_epoch)
        self._clamped: set[str] = set()  # deployments whose replica counts were clamped (warned once)

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
        self.arlo = ArloReplanner(s, self.memory, self.bus, self.subjects, self.state, self._ask)
        await self.bus.listen(self.subjects.event("completed"), Completed, self.handlers.on_completed)
        await self.bus.listen(self.subjects.worker_event("heartbeat"), Heartbeat, self.handlers.on_heartbeat)
        await self.bus.listen(self.subjects.worker_event("down"), WorkerDown, self.handlers.on_worker_down)
        await self.bus.listen(self.subjects.scale_signal("*"), ScaleSignal, self.handlers.on_scale_signal)
        self.background(self._poll_loop(), "poll")
        if s.desired_state_file:
            self.background(self._desired_state_loop(), "desired-state")
        if s.arlo_enabled:
            self.background(self._arlo_loop(), "arlo")

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

    async def _desired_state_loop(self) -> None:
        """Re-apply the desired-state file whenever Redis holds no deployment."""
        keeper, last = DesiredStateKeeper(self.settings.desired_state_file, self.state), ""
        while True:
            try:
                await keeper.ensure()
                last = ""
            except Exception as exc:  # noqa: BLE001 - Redis down or loading: retry next period
                if str(exc) != last:
                    logger.warning("desired-state check failed: %s: %s", type(exc).__name__, exc)
                last = str(exc)
            await asyncio.sleep(self.settings.desired_state_interval_s)

    async def _check_epoch(self) -> None:
        """Notice that Redis lost its data (restart without persistence, FLUSHALL): then no
        deployment seen before counts as deleted (`reconcile.OrphanTracker`)."""
        token, lost = await check_epoch(self.state.r, EPOCH_KEY.format(prefix=self.settings.prefix), self.epoch)
        if lost:
            logger.warning("Redis lost its data (epoch marker gone); no worker is stopped as an orphan "
                           "until deployments are explicitly deleted")
            self.orphans.reset()
        self.epoch = token

    # ------------------------------------------------------------------ reconcile
    def sample_count(self, deployment: str) -> int:
        """Samples held for `deployment` (all of them, not only the current window)."""
        return self.memory.sample_count(deployment)

    @property
    def decisions(self) -> dict[str, ScaleDecision]:
        """The last published decision per deployment."""
        return self.memory.decisions

    async def tick(self) -> list[ScaleDecision]:
        """One reconcile over every deployment; returns the published decisions."""
        async with self._lock:
            await self._check_epoch()
            deployments = await self.state.list_deployments()
            agents = await self.state.live_agents()
            if self.k8s is not None:
                self.memory.live_workers = await self.state.live_workers()
            now = time.time()
            self._track_workers(agents, now)
            known = {d.id for d in deployments}
            self.memory.forget(known, {d.id for d in deployments if d.engine != arlo_live.ENCODER_ENGINE})
            decisions = []
            for dep in map(self._bounded, deployments):
                try:
                    decisions.append(await self._reconcile(dep, agents, now))
                except Exception:  # noqa: BLE001 - one deployment must not stop the others
                    logger.exception("reconcile of deployment %s failed", dep.id)
            if self.settings.stop_orphans:
                await self._stop_orphans(known, agents)
            return decisions

    def _bounded(self, dep: Deployment) -> Deployment:
        """`dep` with its replica counts within max_replicas_limit: the planner never works
        toward (or loops over) a count it read from Redis unchecked (issue 14)."""
        limit, sp = self.settings.max_replicas_limit, dep.scaler
        if sp.max_replicas <= limit and sp.min_replicas <= limit:
            self._clamped.discard(dep.id)
            return dep
        if dep.id not in self._clamped:
            logger.warning("deployment %s asks for %d..%d replicas; clamped to the planner's max_replicas_limit %d",
                           dep.id, sp.min_replicas, sp.max_replicas, limit)
            self._clamped.add(dep.id)
        scaler = msgspec.structs.replace(sp, min_replicas=min(sp.min_replicas, limit),
                                         max_replicas=min(sp.max_replicas, limit))
        return msgspec.structs.replace(dep, scaler=scaler)

    def _track_workers(self, agents: list[AgentInfo], now: float) -> None:
        self.memory.track_workers(agents, now, stale_s=max(600.0, 10 * self.settings.poll_interval_s))

    async def _count(self, dep: Deployment, agents: list[AgentInfo], now: float) -> Count:
        """Where `dep`'s workers are, how many there are and how many are still starting
        (Kubernetes: the replicas, and the pods not serving yet shortly after a change)."""
        m, grace = self.memory, self.settings.worker_start_grace_s
        hosting = {a.gpu_id: [w for w, d in a.workers.items() if d == dep.id] for a in agents}
        ids = [w for ws in hosting.values() for w in ws]
        if self.k8s is None:
            return Count(hosting, len(ids), m.pending(ids, now, grace), m.worker_loads(ids))
        replicas = await asyncio.to_thread(self.k8s.replicas, dep.id)
        pending = 0
        if now - m.last_change.get(dep.id, 0.0) < grace:
            pending = max(0, replicas.desired - m.serving(dep.id))  # pods not serving yet
        serving = [hb.worker_id for hb in m.live_workers if hb.deployment == dep.id]
        return Count({}, replicas.desired, pending, m.worker_loads(serving))

    async def _reconcile(self, dep: Deployment, agents: list[AgentInfo], now: float) -> ScaleDecision:
        """Step `dep`'s autoscaler (`autoscalers.from_policy`, the object the simulator steps
        too) on what was observed, carry out and publish the outcome."""
        s, sp = self.settings, dep.scaler
        scaler = autoscalers.from_policy(sp, stabilization_s=s.scale_down_stabilization_s, tolerance=s.tolerance,
                                         max_step=s.max_step, hold_s=s.tracking_hold_s)
        count = await self._count(dep, agents, now)
        obs = Observation(now=now, current=count.current, pending=count.pending, workers=count.workers,
                          samples=self.memory.samples(dep.id, now, sp.window_s, s.reset_window_on_scale))
        state, out = scaler.step(self.memory.scaler_for(dep.id, scaler), obs)
        self.memory.keep_scaler(dep.id, scaler, state)
        reason = await self._carry_out(dep, agents, count.hosting, count.current, out.desired, out.reason)
        msg = ScaleDecision(deployment=dep.id, scaler=canonical_scaler(sp.type), current=count.current,
                            desired=out.desired, metric_ms=out.metric_ms, threshold_ms=sp.threshold_ms,
                            samples=out.samples, reason=reason)
        await self._announce(msg)
        if out.desired != count.current:
            logger.info("scale %s: %d -> %d (%s)", dep.id, count.current, out.desired, reason)
        return msg

    async def _carry_out(self, dep: Deployment, agents: list[AgentInfo], hosting: dict[str, list[str]],
                         current: int, desired: int, reason: str) -> str:
        """Apply a new worker count (Kubernetes or the gpu-agents); the decision's reason, annotated.
        Stops go by count: each gpu-agent stops its least busy worker(s) of the deployment."""
        if desired == current:
            return reason
        if self.k8s is not None:
            return reason + await self._actuate_k8s(dep, desired)
        if not agents:
            logger.warning("deployment %s wants %d workers, has %d: %s", dep.id, desired, current, NO_AGENT)
            return f"{NO_AGENT}; {reason}"
        return reason + await self._actuate(dep, agents, hosting, current, desired)

    async def _announce(self, msg: ScaleDecision) -> None:
        self.memory.decisions[msg.deployment] = msg
        await self.bus.publish(self.subjects.scale(msg.deployment), msg)
        await self.state.put_plan(msg)

    async def _actuate(self, dep: Deployment, agents: list[AgentInfo], hosting: dict[str, list[str]],
                       current: int, desired: int) -> str:
        """Ask the agents to start or stop workers; returns a note for the decision's reason."""
        changed, failures = 0, []
        if desired > current:
            batch = min(desired - current, self.settings.max_starts_per_tick)  # the rest on later ticks
            plan = policy.plan_starts({a.gpu_id: len(a.workers) for a in agents}, batch)
            for gpu_id, count in plan.items():
                req = StartWorker(deployment=dep.id, model=dep.model, engine=dep.engine, count=count)
                reply = await self._ask(gpu_id, "start", req, failures)
                changed += len(reply.started) if reply else 0
            note = f"; started {changed}" + (f" (at most {batch} per reconcile)" if batch < desired - current else "")
        else:
            plan = policy.plan_stops({g: len(ws) for g, ws in hosting.items()}, current - desired)
            for gpu_id, count in plan.items():
                reply = await self._ask(gpu_id, "stop", StopWorker(deployment=dep.id, count=count), failures)
                changed += len(reply.stopped) if reply else 0
            note = f"; stopped {changed}"
        if changed:
            self.memory.last_change[dep.id] = time.time()
        return note + (f"; failed: {'; '.join(failures)}" if failures else "")

    async def _actuate_k8s(self, dep: Deployment, desired: int) -> str:
        from polyserve.planner.k8s import ActuatorError

        try:
            got = await asyncio.to_thread(self.k8s.scale, dep.id, desired)
        except ActuatorError as exc:
            logger.warning("kubernetes refused to scale %s: %s", dep.id, exc)
            return f"; kubernetes failed: {exc}"
        self.memory.last_change[dep.id] = time.time()
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
        """Stop workers whose deployment was deleted (`reconcile.OrphanTracker`: seen, then
        gone while Redis kept its data; never because a read came back empty after data loss)."""
        hosted = {dep_id for agent in agents for dep_id in agent.workers.values()}
        gone = self.orphans.observe(known, hosted, time.time())
        for agent in agents:
            orphans: dict[str, int] = {}
            for dep_id in agent.workers.values():
                if dep_id in gone:
                    orphans[dep_id] = orphans.get(dep_id, 0) + 1
            for dep_id, count in orphans.items():
                logger.info("deployment %s was deleted; stopping its %d worker(s) on %s", dep_id, count, agent.gpu_id)
                await self._ask(agent.gpu_id, "stop", StopWorker(deployment=dep_id, count=count), [])

    # ------------------------------------------------------------------ scale signals
    async def handle_signal(self, sig: ScaleSignal) -> ScaleDecision | None:
        """Act on one ScaleSignal (see `policy.signal_decision`); the published decision,
        or None when the signal was dropped."""
        async with self._lock:
            dep = await self.state.get_deployment(sig.deployment)
            if dep is None:
                logger.debug("scale signal for unknown deployment %s ignored", sig.deployment)
                return None
            dep = self._bounded(dep)
            m = self.memory
            counts = m.signals.setdefault(dep.id, [0, 0])
            counts[0] += 1
            if sig.source not in policy.signal_sources(dep.scaler.type):
                logger.debug("deployment %s (scaler %s) ignores scale signals from %s",
                             dep.id, dep.scaler.type, sig.source)
                return None
            now = time.time()
            agents = await self.state.live_agents()
            self._track_workers(agents, now)
            if self.k8s is not None:
                m.live_workers = await self.state.live_workers()
            count = await self._count(dep, agents, now)
            decision = policy.signal_decision(count.current, dep.scaler, sig.source, now=now,
                                              last_signal=m.last_signal.get(dep.id),
                                              cooldown_s=self.settings.signal_cooldown_s, pending=count.pending,
                                              reason=sig.reason or (f"gpu {sig.gpu_id}" if sig.gpu_id else ""))
            if decision is None:
                logger.debug("scale signal for %s from %s dropped (cooldown or %d starting)",
                             dep.id, sig.source, count.pending)
                return None
            m.last_signal[dep.id] = now
            counts[1] += 1
            reason = await self._carry_out(dep, agents, count.hosting, count.current, decision.desired,
                                           decision.reason)
            msg = ScaleDecision(deployment=dep.id, scaler=canonical_scaler(dep.scaler.type), current=count.current,
                                desired=decision.desired, threshold_ms=dep.scaler.threshold_ms, reason=reason)
            await self._announce(msg)
            logger.info("scale signal %s: %d -> %d (%s)", dep.id, count.current, decision.desired, reason)
            return msg

    # ------------------------------------------------------------------ Arlo runtime re-plan
    async def _arlo_loop(self) -> None:
        while True:  # the first re-plan runs one period after start: it needs a period of traffic
            await asyncio.sleep(self.settings.arlo_period_s)
            try:
                await self.replan()
            except Exception as exc:  # noqa: BLE001 - Redis/NATS briefly down: the next period retries
                logger.warning("runtime re-plan failed: %s: %s", type(exc).__name__, exc)

    async def replan(self) -> list[RuntimePlan]:
        """One Arlo period over every `encoder` deployment (`arlo_replan`); the published plans."""
        async with self._lock:
            return await self.arlo.replan()
