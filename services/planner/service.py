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

Scale signals: `ScaleSignal`s (dispatcher: Aladdin/CaraServe found no feasible
worker; gpu-agent: MIAD at max clock still missing) grow a deployment whose scaler
type is signal-driven by one worker each (`policy.signal_decision`: cooldown,
starting workers pending, max_replicas), published as a `ScaleDecision` like any
other. Other scaler types ignore them.

Arlo: every `arlo_period_s` the runtimes of `encoder` deployments are re-planned
(`arlo_live.compute_plan`), the `RuntimePlan` published and stored, and, with
`arlo_apply`, carried out through the gpu-agents (stop the instance that changes
runtime, start the new runtime on the same GPU with its `encoder_*` settings).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import msgspec
from opentelemetry.sdk.trace.export import SpanExporter

from polyserve.planner import arlo_live, policy
from polyserve.planner.config import PlannerSettings
from polyserve.planner.handlers import PlannerHandlers
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
        self.lengths: dict[str, deque[tuple[float, int]]] = {}  # deployment -> (ts, input tokens), for Arlo
        self.last_signal: dict[str, float] = {}  # deployment -> when a scale signal was last acted on
        self.signals: dict[str, list[int]] = {}  # deployment -> [received, acted on]
        self.runtime_plans: dict[str, RuntimePlan] = {}
        self.other_deployments: set[str] = set()  # not `encoder`: their request lengths are not kept
        self._runtimes: dict[str, arlo_live.Runtimes | None] = {}  # profile path -> parsed (None: unusable)
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
        await self.bus.listen(self.subjects.scale_signal("*"), ScaleSignal, self.handlers.on_scale_signal)
        self.background(self._poll_loop(), "poll")
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
            self.other_deployments = {d.id for d in deployments if d.engine != arlo_live.ENCODER_ENGINE}
            for dep_id in self.other_deployments & self.lengths.keys():
                del self.lengths[dep_id]
            for table in (self.windows, self.history, self.last_change, self.decisions, self.lengths,
                          self.last_signal, self.signals, self.runtime_plans):
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
        if scaler.type in policy.SIGNAL_SCALERS:
            decision = policy.hold_decision(current, scaler)
        else:
            decision = policy.decide(current, samples, scaler, now=now, history=list(history),
                                     stabilization_s=s.scale_down_stabilization_s, pending=pending,
                                     max_step=s.max_step, tolerance=s.tolerance)
        history.append((now, decision.recommended))
        reason = await self._carry_out(dep, agents, hosting, current, decision.desired, decision.reason)
        msg = ScaleDecision(deployment=dep.id, scaler=scaler.type, current=current,
                            desired=decision.desired, metric_ms=decision.metric_ms,
                            threshold_ms=scaler.threshold_ms, samples=decision.samples, reason=reason)
        await self._announce(msg)
        if decision.desired != current:
            logger.info("scale %s: %d -> %d (%s)", dep.id, current, decision.desired, reason)
        return msg

    async def _carry_out(self, dep: Deployment, agents: list[AgentInfo], hosting: dict[str, list[str]],
                         current: int, desired: int, reason: str) -> str:
        """Apply a new worker count (Kubernetes or the gpu-agents); the decision's reason, annotated."""
        if desired == current:
            return reason
        if self.k8s is not None:
            return reason + await self._actuate_k8s(dep, desired)
        if not agents:
            logger.warning("deployment %s wants %d workers, has %d: %s", dep.id, desired, current, NO_AGENT)
            return f"{NO_AGENT}; {reason}"
        return reason + await self._actuate(dep, agents, hosting, current, desired)

    async def _announce(self, msg: ScaleDecision) -> None:
        self.decisions[msg.deployment] = msg
        await self.bus.publish(self.subjects.scale(msg.deployment), msg)
        await self.state.put_plan(msg)

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

    # ------------------------------------------------------------------ scale signals
    async def handle_signal(self, sig: ScaleSignal) -> ScaleDecision | None:
        """Act on one ScaleSignal (see `policy.signal_decision`); the published decision,
        or None when the signal was dropped."""
        async with self._lock:
            dep = await self.state.get_deployment(sig.deployment)
            if dep is None:
                logger.debug("scale signal for unknown deployment %s ignored", sig.deployment)
                return None
            counts = self.signals.setdefault(dep.id, [0, 0])
            counts[0] += 1
            if sig.source not in policy.signal_sources(dep.scaler.type):
                logger.debug("deployment %s (scaler %s) ignores scale signals from %s",
                             dep.id, dep.scaler.type, sig.source)
                return None
            now = time.time()
            agents = await self.state.live_agents()
            self._track_workers(agents, now)
            hosting = {a.gpu_id: [w for w, d in a.workers.items() if d == dep.id] for a in agents}
            current = sum(len(ws) for ws in hosting.values())
            pending = self._pending([w for ws in hosting.values() for w in ws], now)
            if self.k8s is not None:
                self.live_workers = await self.state.live_workers()
                replicas = await asyncio.to_thread(self.k8s.replicas, dep.id)
                hosting, current = {}, replicas.desired
                pending = max(0, current - self._serving(dep.id)) if (
                    now - self.last_change.get(dep.id, 0.0) < self.settings.worker_start_grace_s) else 0
            decision = policy.signal_decision(current, dep.scaler, sig.source, now=now,
                                              last_signal=self.last_signal.get(dep.id),
                                              cooldown_s=self.settings.signal_cooldown_s, pending=pending,
                                              reason=sig.reason or (f"gpu {sig.gpu_id}" if sig.gpu_id else ""))
            if decision is None:
                logger.debug("scale signal for %s from %s dropped (cooldown or %d starting)",
                             dep.id, sig.source, pending)
                return None
            self.last_signal[dep.id] = now
            counts[1] += 1
            reason = await self._carry_out(dep, agents, hosting, current, decision.desired, decision.reason)
            msg = ScaleDecision(deployment=dep.id, scaler=dep.scaler.type, current=current,
                                desired=decision.desired, threshold_ms=dep.scaler.threshold_ms, reason=reason)
            await self._announce(msg)
            logger.info("scale signal %s: %d -> %d (%s)", dep.id, current, decision.desired, reason)
            return msg

    # ------------------------------------------------------------------ Arlo runtime re-plan
    async def _arlo_loop(self) -> None:
        while True:  # the first re-plan runs one period after start: it needs a period of traffic
            await asyncio.sleep(self.settings.arlo_period_s)
            try:
                await self.replan()
            except Exception as exc:  # noqa: BLE001 - Redis/NATS briefly down: the next period retries
                logger.warning("runtime re-plan failed: %s: %s", type(exc).__name__, exc)

    def runtimes_for(self, workers: list[Heartbeat]) -> arlo_live.Runtimes | None:
        """The runtimes to plan with: `arlo_profile`, else a profile a worker reports that this
        host can read, else the shipped one."""
        candidates = [self.settings.arlo_profile] if self.settings.arlo_profile else []
        candidates += sorted({hb.profile for hb in workers if hb.profile.endswith(".json")})
        candidates.append(str(arlo_live.SHIPPED_PROFILE))
        for path in candidates:
            if path not in self._runtimes:
                try:
                    self._runtimes[path] = arlo_live.load_runtimes(path)
                except ValueError as exc:
                    logger.warning("%s", exc)
                    self._runtimes[path] = None
            if self._runtimes[path] is not None:
                return self._runtimes[path]
            if path == self.settings.arlo_profile:
                return None  # the operator's profile is unusable: say so rather than plan with another
        return None

    async def replan(self) -> list[RuntimePlan]:
        """One Arlo period over every `encoder` deployment; returns the published plans."""
        async with self._lock:
            plans = []
            deployments = [d for d in await self.state.list_deployments() if d.engine == arlo_live.ENCODER_ENGINE]
            if not deployments:
                return plans
            heartbeats = await self.state.live_workers()
            agents = await self.state.live_agents()
            for dep in deployments:
                try:
                    plan = await self._replan_one(dep, heartbeats, agents)
                except Exception:  # noqa: BLE001 - one deployment must not stop the others
                    logger.exception("runtime re-plan of %s failed", dep.id)
                    continue
                if plan is not None:
                    plans.append(plan)
            return plans

    async def _replan_one(self, dep: Deployment, heartbeats: list[Heartbeat],
                          agents: list[AgentInfo]) -> RuntimePlan | None:
        s, now = self.settings, time.time()
        workers = [hb for hb in heartbeats if hb.deployment == dep.id and hb.engine == arlo_live.ENCODER_ENGINE]
        if not workers:
            return None
        rt = self.runtimes_for(workers)
        if rt is None:
            logger.warning("no usable encoder profile for %s (arlo_profile=%r); not re-planning",
                           dep.id, s.arlo_profile)
            return None
        current = {hb.worker_id: arlo_live.instance_runtime(hb.max_input_len, rt.max_lens) for hb in workers}
        load = {hb.worker_id: float(hb.running + hb.waiting) for hb in workers}
        seen = self.lengths.get(dep.id)
        while seen and seen[0][0] < now - s.arlo_period_s:
            seen.popleft()
        lengths = [n for _, n in seen or ()]
        plan, steps = await asyncio.to_thread(arlo_live.compute_plan, dep.id, current, rt, lengths, s.arlo_period_s,
                                              load, s.arlo_min_gain, s.arlo_batch)
        if steps.changes:
            if not s.arlo_apply:
                plan = msgspec.structs.replace(plan, reason=plan.reason + "; publish only (arlo_apply is off)")
            else:
                by_id = {hb.worker_id: hb for hb in workers}
                applied, note = await self._apply_runtimes(dep, rt, steps, by_id, agents)
                plan = msgspec.structs.replace(plan, applied=applied, reason=plan.reason + note)
        self.runtime_plans[dep.id] = plan
        await self.bus.publish(self.subjects.runtime_plan(dep.id), plan)
        await self.state.put_json(self.keys.runtime_plan(dep.id), plan)
        nonzero = lambda c: {k: v for k, v in c.items() if v}  # noqa: E731
        logger.info("runtime plan %s: %s -> %s (%d changes, applied=%s): %s", dep.id, nonzero(plan.previous),
                    nonzero(plan.counts), plan.changes, plan.applied, plan.reason)
        return plan

    async def _apply_runtimes(self, dep: Deployment, rt: arlo_live.Runtimes, steps, by_id: dict[str, Heartbeat],
                              agents: list[AgentInfo]) -> tuple[bool, str]:
        """Carry out a replacement plan batch by batch; (all done, note for the reason)."""
        host = {w: a.gpu_id for a in agents for w in a.workers}
        unmanaged = sorted(st.instance for st in steps.steps if st.instance is not None and st.instance not in host)
        if unmanaged:
            return False, f"; not applied: worker(s) {', '.join(unmanaged)} are not managed by a live gpu-agent"
        if any(st.instance is None for st in steps.steps) and not agents:
            return False, f"; not applied: {NO_AGENT}"
        failures: list[str] = []
        moved = 0
        for batch in steps.batches:
            for st in batch:
                gpu = host.get(st.instance) if st.instance is not None else None
                if st.instance is not None:
                    reply = await self._ask(gpu, "stop", StopWorker(deployment=dep.id, worker_id=st.instance), failures)
                    if reply is None or st.instance not in reply.stopped:
                        continue
                if st.dst is None:
                    moved += 1
                    continue
                if gpu is None:
                    gpu = policy.plan_starts({a.gpu_id: len(a.workers) for a in agents}, 1).popitem()[0]
                old = by_id.get(st.instance) if st.instance is not None else None
                spec = rt.specs[st.dst]
                env = arlo_live.runtime_env(spec, old.profile if old is not None and old.profile else "")
                reply = await self._ask(gpu, "start", StartWorker(deployment=dep.id, model=dep.model, engine=dep.engine,
                                                                  extra_env=env), failures)
                if reply is not None and reply.started:
                    moved += 1
                    self.first_seen.setdefault(reply.started[0], time.time())
        if moved:
            self.last_change[dep.id] = time.time()
        note = f"; applied {moved}/{steps.changes} re-load(s) in {len(steps.batches)} batch(es)"
        return moved == steps.changes and not failures, note + (f"; failed: {'; '.join(failures)}" if failures else "")

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
