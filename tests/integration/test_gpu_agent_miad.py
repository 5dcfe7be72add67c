"""The gpu-agent's MIAD loop against real nats-server and redis-server, on a SIMULATED GPU
only: without allow_clock_control it publishes what it would set and changes nothing;
with it, it sets the simulated clock limit. No NVML setter runs anywhere here."""
import shlex
import sys
import time

import pytest

from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.frequency import clock_subject
from polyserve.gpu_agent.miad import DOWN, UP, ClockDecision
from polyserve.gpu_agent.service import GpuAgentService
from polyserve.proto import AgentReply, Completed, Deployment, ScalerPolicy, StartWorker
from tests.fakes import FAKE_WORKER_PROC as FAKE_WORKER
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration
THRESHOLD_MS = 20.0  # per token


def make_agent(make_settings, tmp_path, **kw):
    base = dict(force_simulated=True, worker_cmd=shlex.join([sys.executable, str(FAKE_WORKER)]),
                worker_log_dir=str(tmp_path), telemetry_interval_s=0.2, agent_ttl_s=2.0, watch_interval_s=0.05,
                miad_interval_s=3600.0, miad_step_mhz=100)  # the loop ticks once at start; the test drives it
    base.update(kw)
    return GpuAgentService(make_settings(GpuAgentSettings, "gpu-agent", **base))


async def setup(agent, bus, subjects, state):
    await state.put_deployment(Deployment(id="d1", model="m", engine="sim", scaler=ScalerPolicy(
        type="pertoken", threshold_ms=THRESHOLD_MS)))
    reply = await bus.request(subjects.agent(agent.gpu_id, "start"),
                              StartWorker(deployment="d1", model="m", engine="sim"), AgentReply, timeout=5)
    got: list[ClockDecision] = []

    async def on_clock(msg):
        got.append(msg)

    await bus.listen(clock_subject(agent.settings.prefix, agent.gpu_id), ClockDecision, on_clock)
    await bus.nc.flush()
    return reply.started[0], got


async def complete(bus, subjects, worker_id, per_token_ms, n=4, tokens=10):
    for i in range(n):
        await bus.publish(subjects.event("completed"), Completed(
            request_id=f"r{time.monotonic_ns()}-{i}", deployment="d1", model="m", worker_id=worker_id,
            input_tokens=8, output_tokens=tokens, e2e_ms=per_token_ms * tokens, ttft_ms=per_token_ms))
    await bus.nc.flush()


async def test_publishes_the_clock_it_would_set_without_touching_the_gpu(make_settings, tmp_path, bus,
                                                                        subjects, state):
    agent = make_agent(make_settings, tmp_path)
    assert agent.settings.allow_clock_control is False  # the default
    async with running(agent):
        wid, got = await setup(agent, bus, subjects, state)
        max_mhz = agent.gpu.spec.max_sm_clock_mhz
        await complete(bus, subjects, wid, per_token_ms=5.0)  # slack 0.75
        await wait_for(lambda: len(agent.frequency.samples.get(wid, ())) == 4, what="completed events")
        d = await agent.frequency.tick()
        assert (d.action, d.freq_mhz, d.previous_mhz, d.applied) == (DOWN, max_mhz - 100, max_mhz, False)
        assert d.simulated is True and d.workers == {wid: pytest.approx(5.0)}
        assert agent.gpu.clock_limit_mhz == max_mhz  # nothing applied
        await wait_for(lambda: any(m.action == DOWN for m in got), what="published ClockDecision")

        await complete(bus, subjects, wid, per_token_ms=40.0)  # mean 22.5 ms: past the SLO
        await wait_for(lambda: len(agent.frequency.samples[wid]) == 8, what="completed events")
        d = await agent.frequency.tick()
        assert d.action == UP and d.freq_mhz == max_mhz and wid in d.missing
        assert agent.gpu.clock_limit_mhz == max_mhz


async def test_applies_to_the_simulated_gpu_with_clock_control(make_settings, tmp_path, bus, subjects, state):
    agent = make_agent(make_settings, tmp_path, allow_clock_control=True, miad_scale_out_after=2)
    async with running(agent):
        assert agent.gpu.simulated  # never a real GPU in tests
        wid, got = await setup(agent, bus, subjects, state)
        max_mhz = agent.gpu.spec.max_sm_clock_mhz
        await complete(bus, subjects, wid, per_token_ms=5.0)
        await wait_for(lambda: len(agent.frequency.samples.get(wid, ())) == 4, what="completed events")
        for k in range(1, 4):
            d = await agent.frequency.tick()
            assert d.applied and d.freq_mhz == max_mhz - 100 * k == agent.gpu.clock_limit_mhz
        await complete(bus, subjects, wid, per_token_ms=30.0, n=40)  # far past the SLO: up, then at max
        await wait_for(lambda: len(agent.frequency.samples[wid]) == 44, what="completed events")
        outs = [await agent.frequency.tick() for _ in range(4)]
        assert outs[0].action == UP and agent.gpu.clock_limit_mhz == max_mhz
        assert [o.scale_out for o in outs] == [False, False, True, True]
        await wait_for(lambda: any(m.scale_out for m in got), what="scale-out signal published")
    assert agent.gpu.clock_limit_mhz == max_mhz  # drained: limit back to the maximum


async def test_scale_out_decision_sends_one_scale_signal_per_deployment(make_settings, tmp_path, bus, subjects,
                                                                        state):
    from polyserve.proto import ScaleSignal

    agent = make_agent(make_settings, tmp_path, miad_scale_out_after=1, telemetry_interval_s=30.0, agent_ttl_s=60.0)
    async with running(agent):
        wid, _ = await setup(agent, bus, subjects, state)
        signals: list[ScaleSignal] = []

        async def on_signal(msg):
            signals.append(msg)

        await bus.listen(subjects.scale_signal("*"), ScaleSignal, on_signal)
        await bus.nc.flush()
        await complete(bus, subjects, wid, per_token_ms=5.0)  # within the SLO: no signal
        await wait_for(lambda: len(agent.frequency.samples.get(wid, ())) == 4, what="completed events")
        assert not (await agent.frequency.tick()).scale_out
        await complete(bus, subjects, wid, per_token_ms=60.0, n=20)  # at max clock and missing
        await wait_for(lambda: len(agent.frequency.samples[wid]) == 24, what="completed events")
        outs = [await agent.frequency.tick() for _ in range(3)]  # up to max (the first tick lowered it), then at max
        assert [o.scale_out for o in outs] == [False, True, True]
        await wait_for(lambda: signals, what="ScaleSignal")
        await bus.nc.flush()
        [sig] = signals  # one per deployment per telemetry interval, however many decisions
        assert (sig.deployment, sig.source, sig.gpu_id) == ("d1", "miad", agent.gpu_id) and wid in sig.reason
