"""Arlo's runtime re-plan in the live planner: the I/O around `arlo_live.compute_plan`.

Every `arlo_period_s` the service calls `ArloReplanner.replan`: for each `encoder`
deployment with live workers, the request lengths of the last period (kept in
`PlannerState.lengths`) and the workers' current runtimes give a `RuntimePlan`, which
is published and stored and, with `arlo_apply`, carried out through the gpu-agents
(stop the instance that changes runtime, start the new runtime on the same GPU with
its `encoder_*` settings), batch by batch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from polyserve.planner import arlo_live, policy
from polyserve.planner.config import PlannerSettings
from polyserve.planner.state import PlannerState
from polyserve.proto import AgentInfo, AgentReply, Deployment, Heartbeat, RuntimePlan, StartWorker, StopWorker

logger = logging.getLogger(__name__)

NO_AGENT = "no gpu-agent available"
Ask = Callable[[str, str, "StartWorker | StopWorker", list[str]], Awaitable["AgentReply | None"]]


class ArloReplanner:
    """Re-plans the runtimes of `encoder` deployments (module docstring).

    `store` is the service's Redis state (deployments, live workers and agents, plans);
    `ask(gpu_id, action, request, failures)` asks one gpu-agent and notes a failure."""

    def __init__(self, settings: PlannerSettings, memory: PlannerState, bus, subjects, store, ask: Ask):
        self.settings, self.memory = settings, memory
        self.bus, self.subjects, self.store, self.ask = bus, subjects, store, ask
        self._runtimes: dict[str, arlo_live.Runtimes | None] = {}  # profile path -> parsed (None: unusable)

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
        plans = []
        deployments = [d for d in await self.store.list_deployments() if d.engine == arlo_live.ENCODER_ENGINE]
        if not deployments:
            return plans
        heartbeats = await self.store.live_workers()
        agents = await self.store.live_agents()
        for dep in deployments:
            try:
                plan = await self.replan_one(dep, heartbeats, agents)
            except Exception:  # noqa: BLE001 - one deployment must not stop the others
                logger.exception("runtime re-plan of %s failed", dep.id)
                continue
            if plan is not None:
                plans.append(plan)
        return plans

    def _lengths(self, dep_id: str, now: float) -> list[int]:
        """Input lengths of the last period (older ones are dropped)."""
        seen = self.memory.lengths.get(dep_id)
        while seen and seen[0][0] < now - self.settings.arlo_period_s:
            seen.popleft()
        return [n for _, n in seen or ()]

    async def replan_one(self, dep: Deployment, heartbeats: list[Heartbeat],
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
        plan, steps = await asyncio.to_thread(arlo_live.compute_plan, dep.id, current, rt, self._lengths(dep.id, now),
                                              s.arlo_period_s, load, s.arlo_min_gain, s.arlo_batch)
        if steps.changes:
            if not s.arlo_apply:
                plan = msgspec.structs.replace(plan, reason=plan.reason + "; publish only (arlo_apply is off)")
            else:
                by_id = {hb.worker_id: hb for hb in workers}
                applied, note = await self.apply(dep, rt, steps, by_id, agents)
                plan = msgspec.structs.replace(plan, applied=applied, reason=plan.reason + note)
        self.memory.runtime_plans[dep.id] = plan
        await self.bus.publish(self.subjects.runtime_plan(dep.id), plan)
        await self.store.put_json(self.store.keys.runtime_plan(dep.id), plan)
        nonzero = lambda c: {k: v for k, v in c.items() if v}  # noqa: E731
        logger.info("runtime plan %s: %s -> %s (%d changes, applied=%s): %s", dep.id, nonzero(plan.previous),
                    nonzero(plan.counts), plan.changes, plan.applied, plan.reason)
        return plan

    async def apply(self, dep: Deployment, rt: arlo_live.Runtimes, steps, by_id: dict[str, Heartbeat],
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
                moved += await self._move(dep, rt, st, host, by_id, agents, failures)
        if moved:
            self.memory.last_change[dep.id] = time.time()
        note = f"; applied {moved}/{steps.changes} re-load(s) in {len(steps.batches)} batch(es)"
        return moved == steps.changes and not failures, note + (f"; failed: {'; '.join(failures)}" if failures else "")

    async def _move(self, dep: Deployment, rt: arlo_live.Runtimes, st, host: dict[str, str],
                    by_id: dict[str, Heartbeat], agents: list[AgentInfo], failures: list[str]) -> int:
        """One step: stop its instance (if any), start its new runtime (if any); 1 when done."""
        gpu = host.get(st.instance) if st.instance is not None else None
        if st.instance is not None:
            reply = await self.ask(gpu, "stop", StopWorker(deployment=dep.id, worker_id=st.instance), failures)
            if reply is None or st.instance not in reply.stopped:
                return 0
        if st.dst is None:
            return 1
        if gpu is None:
            gpu = policy.plan_starts({a.gpu_id: len(a.workers) for a in agents}, 1).popitem()[0]
        old = by_id.get(st.instance) if st.instance is not None else None
        env = arlo_live.runtime_env(rt.specs[st.dst], old.profile if old is not None and old.profile else "")
        reply = await self.ask(gpu, "start", StartWorker(deployment=dep.id, model=dep.model, engine=dep.engine,
                                                         extra_env=env), failures)
        if reply is not None and reply.started:
            self.memory.first_seen.setdefault(reply.started[0], time.time())
            return 1
        return 0
