"""The gpu-agent's energy accounting against real nats-server and redis-server: a SIMULATED
GPU of known power (driven by a test clock), completed events of its own worker and of a
worker elsewhere; the published and stored EnergyReport match a hand computation."""
import shlex
import sys

import pytest

from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.gpu import SimulatedGpu
from polyserve.gpu_agent.service import GpuAgentService
from polyserve.proto import AgentReply, Completed, EnergyReport, Heartbeat, StartWorker
from tests.fakes import FAKE_WORKER_PROC as FAKE_WORKER
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


async def test_energy_report_splits_the_window_over_completed_requests(make_settings, tmp_path, bus, subjects,
                                                                       state):
    clock = Clock()
    gpu = SimulatedGpu(clock=clock)  # idle 60 W; busy 60 + 240 * u at max clock
    agent = GpuAgentService(make_settings(
        GpuAgentSettings, "gpu-agent", force_simulated=True, miad_enabled=False, worker_log_dir=str(tmp_path),
        worker_cmd=shlex.join([sys.executable, str(FAKE_WORKER)]), telemetry_interval_s=3600.0,
        agent_ttl_s=7200.0, watch_interval_s=0.05), gpu=gpu)
    reports: list[EnergyReport] = []

    async def on_report(msg):
        reports.append(msg)

    async with running(agent):  # the telemetry loop's first reading opens the first window
        await bus.listen(subjects.gpu_energy(agent.gpu_id), EnergyReport, on_report)
        reply = await bus.request(subjects.agent(agent.gpu_id, "start"),
                                  StartWorker(deployment="d1", model="m", engine="sim"), AgentReply, timeout=5)
        [wid] = reply.started
        await bus.publish(subjects.worker_event("heartbeat"), Heartbeat(
            worker_id=wid, deployment="d1", model="m", engine="sim", running=2))  # u = 2 / (2 + 2) = 0.5
        await wait_for(lambda: agent.load.get(wid) == 2, what="heartbeat load")
        first = await agent.account_energy(await agent.read_gpu())  # the load applies from here on
        if first is None:  # this reading opened the first window (the loop's had not run yet)
            first = await agent.account_energy(await agent.read_gpu())
        assert first.energy_j == 0 and first.requests == 0 and first.source == "model" and first.simulated

        for i, (inp, out) in enumerate([(100, 50), (20, 30)]):
            await bus.publish(subjects.event("completed"), Completed(
                request_id=f"r{i}", deployment="d1", model="m", worker_id=wid, input_tokens=inp,
                output_tokens=out, e2e_ms=100.0, ttft_ms=10.0))
        await bus.publish(subjects.event("completed"), Completed(  # another GPU's worker: not ours
            request_id="other", deployment="d1", model="m", worker_id="w-elsewhere", input_tokens=5,
            output_tokens=500, e2e_ms=100.0, ttft_ms=10.0))
        await bus.nc.flush()
        await wait_for(lambda: len(agent.energy.done) == 2, what="completed events")
        clock.t += 2.0
        await agent.publish_telemetry()
        await wait_for(lambda: any(r.requests for r in reports), what="published EnergyReport")
        [rep] = [r for r in reports if r.requests]
        assert rep.energy_j == pytest.approx(180.0 * 2.0)  # (60 + 240 x 0.5) W x 2 s
        assert (rep.requests, rep.output_tokens, rep.tokens) == (2, 80, 200)
        assert rep.j_per_request == pytest.approx(180.0) and rep.j_per_token == pytest.approx(360.0 / 80)
        assert rep.per_worker_j == pytest.approx({wid: 360.0})
        stored = await state.get_json(agent.energy_key(), EnergyReport)
        assert stored == rep
        total = await state.get_json(agent.energy_key(total=True), EnergyReport)
        assert total.energy_j == pytest.approx(360.0) and total.requests == 2
