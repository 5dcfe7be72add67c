"""The gpu-agent: one per GPU. Telemetry, presence in Redis, and the worker processes.

Loops: telemetry (GpuTelemetry + AgentInfo every `telemetry_interval_s`, and
the window's EnergyReport, `energy.py`), the
watcher (every `watch_interval_s`: reaps workers, SIGKILLs those past their
stop deadline, reports the ones that died on their own) and, with
`miad_enabled`, the MIAD frequency controller (`frequency.py`), which applies
clocks only with `allow_clock_control`. The agent never restarts a worker by
itself: the planner reconciles.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from opentelemetry.sdk.trace.export import SpanExporter

from polyserve.gpu_agent import policy
from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.energy import EnergyMeter, energy_source
from polyserve.gpu_agent.frequency import FrequencyController
from polyserve.gpu_agent.gpu import Gpu, GpuReading, detect_gpu
from polyserve.gpu_agent.handlers import AgentHandlers
from polyserve.gpu_agent.workers import WorkerPool, WorkerProc
from polyserve.proto import (
    AgentInfo,
    Completed,
    EnergyReport,
    GpuTelemetry,
    Heartbeat,
    Refused,
    StartWorker,
    StopWorker,
    WorkerDown,
)
from polyserve.shared.lifecycle import ServiceBase

logger = logging.getLogger(__name__)


class GpuAgentService(ServiceBase):
    """Publishes GPU telemetry, keeps AgentInfo in Redis, starts/stops/watches workers."""

    name = "gpu-agent"

    def __init__(self, settings: GpuAgentSettings, *, span_exporter: SpanExporter | None = None,
                 gpu: Gpu | None = None):
        super().__init__(settings, span_exporter=span_exporter)
        self.settings: GpuAgentSettings = settings
        self.gpu: Gpu | None = gpu
        self.gpu_id = settings.gpu_id
        self.pool = WorkerPool(settings)
        self.energy = EnergyMeter(settings.gpu_id)
        self.handlers = AgentHandlers(settings, self.pool, self.energy, spawn=self.spawn_worker,
                                      publish_info=self.publish_info, gpu_id=lambda: self.gpu_id,
                                      publish_refusal=self.publish_refusal)
        self.frequency = FrequencyController(self)

    # ------------------------------------------------------------------ lifecycle
    async def on_start(self) -> None:
        s = self.settings
        if self.gpu is None:
            self.gpu = await asyncio.to_thread(detect_gpu, s.gpu_index, s.force_simulated)
        self.gpu_id = policy.resolve_gpu_id(s.gpu_id, s.gpu_index, self.gpu.simulated)
        self.energy.gpu_id = self.gpu_id
        self.pool.open_log_dir(self.gpu_id)
        for other in await self.state.live_agents():
            if other.gpu_id == self.gpu_id:
                logger.warning("another gpu-agent (pid %d) is live for %s; ids will clash",
                               other.pid, self.gpu_id)
        await self.bus.serve(self.subjects.agent(self.gpu_id, "start"), StartWorker, self.handlers.start)
        await self.bus.serve(self.subjects.agent(self.gpu_id, "stop"), StopWorker, self.handlers.stop)
        await self.bus.listen(self.subjects.worker_event("heartbeat"), Heartbeat, self.handlers.on_heartbeat)
        await self.bus.listen(self.subjects.event("completed"), Completed, self.handlers.on_completed)
        await self.publish_info()
        self.background(self._telemetry_loop(), "telemetry")
        self.background(self._watch_loop(), "watch")
        if s.miad_enabled:
            await self.frequency.start()
            self.background(self.frequency.loop(), "miad")
        logger.info("gpu-agent %s (%s, simulated=%s); worker logs in %s",
                    self.gpu_id, self.gpu.name, self.gpu.simulated, self.pool.log_dir)

    async def on_drain(self, timeout: float) -> None:
        """SIGTERM every worker, wait up to `timeout`, SIGKILL stragglers, leave Redis."""
        self.stop_workers([w.worker_id for w in self.workers.values() if not w.stopping], timeout)
        deadline = time.monotonic() + timeout
        while self.workers and time.monotonic() < deadline:
            await self.reap()
            await asyncio.sleep(min(self.settings.watch_interval_s, 0.1))
        for w in self.workers.values():
            w.kill_at = time.monotonic()  # past the drain timeout: SIGKILL now
        deadline = time.monotonic() + 2.0
        while self.workers and time.monotonic() < deadline:
            await self.reap()
            await asyncio.sleep(0.05)
        if self.workers:
            logger.error("workers %s did not exit even after SIGKILL", sorted(self.workers))
        try:
            await self.state.remove_agent(self.gpu_id)
        except Exception as exc:  # noqa: BLE001 - Redis down at shutdown: the TTL cleans up
            logger.warning("could not deregister agent %s: %s", self.gpu_id, exc)
        try:
            self.frequency.close()  # locked clocks back to the driver's default
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not restore clocks on %s: %s", self.gpu_id, exc)
        if self.gpu is not None:
            self.gpu.close()

    # ------------------------------------------------------------------ state
    @property
    def workers(self) -> dict[str, WorkerProc]:
        """This agent's worker processes by id (the pool's)."""
        return self.pool.workers

    @property
    def load(self) -> dict[str, int]:
        """worker_id -> running + waiting, from heartbeats (the pool's)."""
        return self.pool.load

    def info(self) -> AgentInfo:
        """This agent as the planner sees it: workers not being stopped."""
        return AgentInfo(gpu_id=self.gpu_id, simulated=bool(self.gpu and self.gpu.simulated),
                         control_subject=self.subjects.agent(self.gpu_id, "*"),
                         workers={w.worker_id: w.deployment for w in self.workers.values() if not w.stopping},
                         pid=os.getpid())

    async def publish_info(self) -> None:
        """Refresh AgentInfo in Redis (after every change, so counts are current)."""
        try:
            await self.state.put_agent(self.info(), self.settings.agent_ttl_s)
        except Exception as exc:  # noqa: BLE001 - Redis briefly down: the next interval retries
            logger.warning("cannot refresh AgentInfo of %s: %s", self.gpu_id, exc)

    async def publish_refusal(self, event: Refused) -> None:
        """A refused request, for operators (`polyserve events`): `<prefix>.v1.events.service.refused`."""
        await self.bus.publish(self.subjects.service_event("refused"), event)

    # ------------------------------------------------------------------ workers
    def spawn_worker(self, req: StartWorker) -> str:
        """Start one worker process for `req` on this GPU; returns its id. Raises OSError if it cannot."""
        cuda = "" if self.gpu is None or self.gpu.simulated else (self.gpu.uuid or str(self.settings.gpu_index))
        return self.pool.spawn(req, self.gpu_id, cuda)

    def stop_workers(self, worker_ids: list[str], timeout: float) -> list[str]:
        """SIGTERM the named workers; the watcher SIGKILLs them after `timeout`."""
        return self.pool.stop(worker_ids, timeout)

    async def reap(self) -> None:
        """Collect exited workers (SIGKILL stopping ones past their deadline) and tell the cluster."""
        gone = self.pool.reap()
        for w, reason, _ in gone:
            await self._worker_gone(w, reason)
        if any(unexpected for _, _, unexpected in gone):
            await self.publish_info()

    async def _worker_gone(self, w: WorkerProc, reason: str) -> None:
        """Tell the cluster at once, so the dispatcher stops placing on it."""
        down = WorkerDown(worker_id=w.worker_id, reason=reason, deployment=w.deployment, gpu_id=self.gpu_id)
        try:
            await self.bus.publish(self.subjects.worker_event("down"), down)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cannot publish WorkerDown for %s: %s", w.worker_id, exc)
        try:
            await self.state.remove_worker(w.worker_id)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cannot remove worker %s from Redis: %s", w.worker_id, exc)

    # ------------------------------------------------------------------ loops
    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad round
                logger.exception("worker watcher round failed")
            await asyncio.sleep(self.settings.watch_interval_s)

    async def _telemetry_loop(self) -> None:
        while True:
            try:
                await self.publish_telemetry()
            except Exception as exc:  # noqa: BLE001 - NATS reconnecting; keep the loop
                logger.warning("telemetry round failed: %s", exc)
            await self.publish_info()
            await asyncio.sleep(self.settings.telemetry_interval_s)

    async def read_gpu(self) -> GpuReading:
        """One reading; the simulation is fed the load its workers report."""
        assert self.gpu is not None
        active = self.pool.active()
        self.gpu.set_load(sum(self.load.get(w.worker_id, 0) for w in active), len(active))
        if self.gpu.simulated:
            return self.gpu.read()
        return await asyncio.to_thread(self.gpu.read)  # NVML calls block

    async def publish_telemetry(self) -> GpuTelemetry:
        r = await self.read_gpu()
        msg = GpuTelemetry(gpu_id=self.gpu_id, name=r.name, simulated=r.simulated, power_w=r.power_w,
                           energy_j=r.energy_j, sm_clock_mhz=r.sm_clock_mhz, mem_clock_mhz=r.mem_clock_mhz,
                           max_sm_clock_mhz=r.max_sm_clock_mhz, util_gpu_pct=r.util_gpu_pct,
                           util_mem_pct=r.util_mem_pct, mem_used_mb=r.mem_used_mb, mem_total_mb=r.mem_total_mb,
                           workers=sorted(self.workers))
        await self.bus.publish(self.subjects.gpu_telemetry(self.gpu_id), msg)
        try:
            await self.state.put_json(self.keys.gpu(self.gpu_id), msg, ttl=self.settings.agent_ttl_s)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cannot store telemetry of %s: %s", self.gpu_id, exc)
        await self.account_energy(r)
        return msg

    def energy_key(self, total: bool = False) -> str:
        """Redis key of the latest EnergyReport (`total`: the running total since start)."""
        return self.keys.gpu_energy(self.gpu_id, total)

    async def account_energy(self, reading: GpuReading) -> EnergyReport | None:
        """Close the energy window at `reading`; publish and store its report."""
        rep = self.energy.observe(reading, time.time(), energy_source(self.gpu, reading))
        if rep is None:
            return None
        await self.bus.publish(self.subjects.gpu_energy(self.gpu_id), rep)
        try:
            ttl = max(self.settings.agent_ttl_s, 3 * self.settings.telemetry_interval_s)
            await self.state.put_json(self.energy_key(), rep, ttl=ttl)
            await self.state.put_json(self.energy_key(total=True), self.energy.total, ttl=ttl)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cannot store the energy report of %s: %s", self.gpu_id, exc)
        return rep
