"""The gpu-agent's MIAD loop: latencies in, a clock decision out, applied only when the
operator allowed clock control (see `miad.py` for the algorithm and `config.py` for
the settings).

Each hosted worker's latency is the mean, over the completed requests of the last
`miad_window_s`, of the metric its deployment's scaler uses (per-token latency
e2e/output_tokens for `pertoken`, e2e for `request`); its target is `miad_slo_ms`
or else that scaler's threshold. Its weight is the frequency elasticity of an LLM
request with the same prefill (ttft − queue) and decode (e2e − ttft) times at the
current clock (`gpu_model.llm_request`).

Scale-out: when a decision says `scale_out` (at max clock, still missing), the agent
publishes a `ScaleSignal(source="miad")` for each deployment of the workers it names
as missing (all hosted deployments if it names none), at most once per deployment
per `telemetry_interval_s`; the planner decides (cooldown, max_replicas).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from polyserve.gpu_agent import gpu_model, miad
from polyserve.gpu_agent.clock_control import ClockActuator, choose_actuator
from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.gpu import Gpu, GpuReading
from polyserve.gpu_agent.workers import WorkerProc
from polyserve.proto import Completed, ScaleSignal, Subjects
from polyserve.shared.bus import Bus
from polyserve.shared.state import State

logger = logging.getLogger(__name__)
SLO_REFRESH_S = 5.0
MAX_SAMPLES = 4096


@dataclass(frozen=True)
class LatencySample:
    ts: float
    e2e_ms: float
    output_tokens: int
    prefill_ms: float
    decode_ms: float


class AgentPort(Protocol):
    """What the MIAD loop uses of its gpu-agent (the service implements it)."""

    settings: GpuAgentSettings
    gpu: Gpu | None
    gpu_id: str
    bus: Bus
    state: State
    subjects: Subjects
    workers: dict[str, WorkerProc]

    async def read_gpu(self) -> GpuReading: ...


class FrequencyController:
    """State of the MIAD loop of one agent."""

    def __init__(self, agent: AgentPort):
        self.agent = agent
        self.samples: dict[str, deque[LatencySample]] = {}
        self.targets: dict[str, tuple[str, float]] = {}  # deployment -> (metric, target ms)
        self._targets_at = 0.0
        self.cfg: miad.MiadConfig | None = None
        self.state: miad.MiadState | None = None
        self.actuator: ClockActuator | None = None
        self.last: miad.ClockDecision | None = None
        self._published_at = 0.0
        self._signalled: dict[str, float] = {}  # deployment -> when a ScaleSignal was last sent

    async def start(self) -> None:
        s, agent = self.agent.settings, self.agent
        reading = await agent.read_gpu()
        max_mhz = reading.max_sm_clock_mhz or 1410
        self.cfg = miad.MiadConfig(min_mhz=min(s.miad_min_clock_mhz, max_mhz), max_mhz=max_mhz,
                                   step_mhz=s.miad_step_mhz, threshold=s.miad_threshold,
                                   down_requires_all=s.miad_down_requires_all,
                                   scale_out_after=s.miad_scale_out_after)
        self.state = miad.initial_state(self.cfg)
        self.actuator = choose_actuator(agent.gpu, s.allow_clock_control, self.cfg.min_mhz)
        if self.actuator is not None:
            self.actuator.apply(self.state.freq_mhz)  # Alg. 3 line 4
        await agent.bus.listen(agent.subjects.event("completed"), Completed, self.on_completed)
        logger.info("MIAD on %s: %d-%d MHz, step %d, %s", agent.gpu_id, self.cfg.min_mhz, max_mhz,
                    self.cfg.step_mhz, "APPLYING clocks" if self.actuator else "publishing only (no clock control)")

    async def on_completed(self, ev: Completed) -> None:
        if ev.worker_id not in self.agent.workers:
            return
        window = self.samples.setdefault(ev.worker_id, deque(maxlen=MAX_SAMPLES))
        prefill = max(0.0, ev.ttft_ms - ev.queue_ms)
        window.append(LatencySample(time.time(), ev.e2e_ms, ev.output_tokens, prefill, max(0.0, ev.e2e_ms - ev.ttft_ms)))

    async def _refresh_targets(self, now: float) -> None:
        if now - self._targets_at < SLO_REFRESH_S and self.targets:
            return
        deps = await self.agent.state.list_deployments()
        slo = self.agent.settings.miad_slo_ms
        self.targets = {d.id: (d.scaler.type, slo or d.scaler.threshold_ms) for d in deps}
        self._targets_at = now

    def observations(self, now: float) -> tuple[list[miad.PartitionObs], dict[str, float]]:
        """One PartitionObs per running worker (actual None when it completed nothing lately)."""
        assert self.cfg is not None and self.state is not None
        x = self.state.freq_mhz / self.cfg.max_mhz
        obs, seen = [], {}
        for wid, w in self.agent.workers.items():
            if w.stopping:
                continue
            metric, target = self.targets.get(w.deployment, ("pertoken", 0.0))
            window = self.samples.get(wid, deque())
            while window and window[0].ts < now - self.agent.settings.miad_window_s:
                window.popleft()
            if metric == "pertoken":
                vals = [s.e2e_ms / s.output_tokens for s in window if s.output_tokens > 0]
            else:
                vals = [s.e2e_ms for s in window]
            actual = sum(vals) / len(vals) if vals else None
            weight = 1.0
            if window:
                pre = sum(s.prefill_ms for s in window) / len(window)
                dec = sum(s.decode_ms for s in window) / len(window)
                weight = gpu_model.llm_request(pre, dec).elasticity(x)
            if actual is not None:
                seen[wid] = round(actual, 3)
            obs.append(miad.PartitionObs(wid, target, actual, weight))
        for wid in [k for k in self.samples if k not in self.agent.workers]:
            del self.samples[wid]
        return obs, seen

    async def tick(self) -> miad.ClockDecision | None:
        """One control period: decide, apply if allowed, publish when something changed."""
        if self.cfg is None or self.state is None:
            return None
        agent, now = self.agent, time.time()
        try:
            await self._refresh_targets(now)
        except Exception as exc:  # noqa: BLE001 - Redis briefly down: keep the old targets
            logger.warning("cannot refresh SLO targets: %s", exc)
        obs, seen = self.observations(now)
        self.state, d = miad.miad_step(self.state, obs, self.cfg)
        applied = False
        if self.actuator is not None and d.freq_mhz != d.previous_mhz:
            try:
                self.actuator.apply(d.freq_mhz)
                applied = True
            except Exception as exc:  # noqa: BLE001 - e.g. NVML permission denied: say so, keep running
                logger.error("cannot set the SM clock to %d MHz: %s", d.freq_mhz, exc)
        msg = miad.ClockDecision(ts=now, gpu_id=agent.gpu_id, simulated=bool(agent.gpu and agent.gpu.simulated),
                                 applied=applied or (self.actuator is not None and d.freq_mhz == d.previous_mhz),
                                 freq_mhz=d.freq_mhz, previous_mhz=d.previous_mhz, action=d.action,
                                 reason=d.reason, scale_out=d.scale_out, missing=list(d.missing), workers=seen)
        changed = d.action != miad.SAME or d.scale_out or self.last is None
        if changed or now - self._published_at >= agent.settings.telemetry_interval_s:
            await agent.bus.publish(clock_subject(agent.settings.prefix, agent.gpu_id), msg)
            self._published_at = now
        if d.scale_out:
            await self.signal_scale_out(msg, now)
        self.last = msg
        return msg

    async def signal_scale_out(self, msg: miad.ClockDecision, now: float) -> list[ScaleSignal]:
        """Ask the planner for one more worker of each deployment missing its SLO here."""
        agent = self.agent
        hosted = {w.worker_id: w.deployment for w in agent.workers.values() if not w.stopping}
        deps = sorted({hosted[w] for w in msg.missing if w in hosted} or set(hosted.values()))
        sent = []
        for dep in deps:
            if now - self._signalled.get(dep, float("-inf")) < agent.settings.telemetry_interval_s:
                continue
            sig = ScaleSignal(ts=now, deployment=dep, source="miad", gpu_id=agent.gpu_id,
                              reason=f"MIAD on {agent.gpu_id} at {msg.freq_mhz} MHz (max) still misses the SLO "
                                     f"of {', '.join(w for w in msg.missing if hosted.get(w) == dep) or 'its workers'}")
            await agent.bus.publish(agent.subjects.scale_signal(dep), sig)
            self._signalled[dep] = now
            sent.append(sig)
        return sent

    async def loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - NATS reconnecting; next period retries
                logger.warning("MIAD round failed: %s", exc)
            await asyncio.sleep(self.agent.settings.miad_interval_s)

    def close(self) -> None:
        if self.actuator is not None:
            self.actuator.close()


def clock_subject(prefix: str, gpu_id: str) -> str:
    """Where ClockDecisions go (`Subjects.gpu_clock`)."""
    return Subjects(prefix).gpu_clock(gpu_id)
