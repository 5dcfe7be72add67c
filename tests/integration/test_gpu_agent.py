"""gpu-agent against real nats-server and redis-server, with a stand-in worker process."""
import os
import shlex
import signal
import sys
from pathlib import Path

import pytest

from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.service import GpuAgentService
from polyserve.proto import AgentReply, GpuTelemetry, Heartbeat, StartWorker, StopWorker, WorkerDown
from polyserve.shared.bus import BusError
from polyserve.shared.infra import pid_alive
from tests.fakes import FAKE_WORKER_PROC as FAKE_WORKER
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def make_agent(make_settings, tmp_path):
    def build(**overrides):
        base = dict(force_simulated=True, worker_cmd=shlex.join([sys.executable, str(FAKE_WORKER)]),
                    worker_log_dir=str(tmp_path), telemetry_interval_s=0.2, agent_ttl_s=2.0,
                    watch_interval_s=0.05, worker_env_allow="FAKE_WORKER_EXIT,FAKE_WORKER_IGNORE_TERM")
        base.update(overrides)
        return GpuAgentService(make_settings(GpuAgentSettings, "gpu-agent", **base))
    return build


async def collect(bus, subject, typ):
    got = []

    async def handler(msg):
        got.append(msg)

    await bus.listen(subject, typ, handler)
    await bus.nc.flush()
    return got


def start_req(count=1, **env):
    return StartWorker(deployment="d1", model="m", engine="sim", count=count, extra_env=env)


async def agent_workers(state):
    agents = await state.live_agents()
    return agents[0].workers if agents else None


async def test_start_lists_workers_then_stop_removes_them(make_agent, bus, subjects, state, tmp_path):
    agent = make_agent()
    async with running(agent):
        assert agent.gpu_id == "sim0"
        start = subjects.agent("sim0", "start")
        reply = await bus.request(start, start_req(count=2), AgentReply, timeout=5)
        assert reply.gpu_id == "sim0" and len(reply.started) == 2
        assert all(w.startswith("w-") for w in reply.started)
        assert await agent_workers(state) == {w: "d1" for w in reply.started}  # before any heartbeat
        pids = {w: agent.workers[w].proc.pid for w in reply.started}
        for wid in reply.started:  # stdout goes to a file per worker, with the identity from env
            log = tmp_path / f"{wid}.log"
            await wait_for(lambda: log.exists() and wid in log.read_text(), what=f"{wid} log")
            assert f"prefix={agent.settings.prefix}" in log.read_text()

        stop = await bus.request(subjects.agent("sim0", "stop"), StopWorker(deployment="d1"), AgentReply, timeout=5)
        assert stop.stopped == [reply.started[-1]]  # the most recently started one
        assert await agent_workers(state) == {reply.started[0]: "d1"}
        await wait_for(lambda: reply.started[-1] not in agent.workers, what="stopped worker reaped")
        assert not pid_alive(pids[reply.started[-1]])

        with pytest.raises(BusError) as err:
            await bus.request(subjects.agent("sim0", "stop"), StopWorker(deployment="d1", worker_id="w-nope"),
                              AgentReply, timeout=5)
        assert err.value.code == 404
        with pytest.raises(BusError) as err:
            await bus.request(start, start_req(count=0), AgentReply, timeout=5)
        assert err.value.code == 400 and "count" in err.value.description
        empty = await bus.request(subjects.agent("sim0", "stop"), StopWorker(deployment="other"), AgentReply,
                                  timeout=5)
        assert empty.stopped == []
    # drain: the remaining worker is terminated and the agent leaves the live set
    assert not pid_alive(pids[reply.started[0]])
    assert await state.live_agents() == []


async def test_killed_worker_is_reported_down_at_once(make_agent, bus, subjects, state):
    downs = await collect(bus, subjects.worker_event("down"), WorkerDown)
    agent = make_agent()
    async with running(agent):
        reply = await bus.request(subjects.agent("sim0", "start"), start_req(), AgentReply, timeout=5)
        wid = reply.started[0]
        await state.put_worker(Heartbeat(worker_id=wid, deployment="d1", model="m", engine="sim", ttl_s=60))
        os.kill(agent.workers[wid].proc.pid, signal.SIGKILL)
        await wait_for(lambda: downs, timeout=5, what="WorkerDown")
        assert downs[0].worker_id == wid and downs[0].deployment == "d1" and downs[0].gpu_id == "sim0"
        assert downs[0].reason.startswith("worker process exited with code -9")
        assert [w.worker_id for w in await state.live_workers()] == []
        assert await agent_workers(state) == {}

        reply = await bus.request(subjects.agent("sim0", "start"), start_req(FAKE_WORKER_EXIT="3"),
                                  AgentReply, timeout=5)
        await wait_for(lambda: len(downs) == 2, timeout=5, what="second WorkerDown")
        assert downs[1].worker_id == reply.started[0]
        assert downs[1].reason == "worker process exited with code 3"


async def test_worker_ignoring_sigterm_is_killed_after_drain_timeout(make_agent, bus, subjects):
    downs = await collect(bus, subjects.worker_event("down"), WorkerDown)
    agent = make_agent(drain_timeout_s=0.5)
    async with running(agent):
        reply = await bus.request(subjects.agent("sim0", "start"), start_req(FAKE_WORKER_IGNORE_TERM="1"),
                                  AgentReply, timeout=5)
        wid = reply.started[0]
        log = Path(agent.workers[wid].log_path)
        await wait_for(lambda: log.exists() and wid in log.read_text(), what="worker running")  # handler set
        pid = agent.workers[wid].proc.pid
        stop = await bus.request(subjects.agent("sim0", "stop"), StopWorker(deployment="d1"), AgentReply, timeout=5)
        assert stop.stopped == [wid]
        await wait_for(lambda: downs, timeout=5, what="WorkerDown after SIGKILL")
        assert "killed by gpu-agent after its drain timeout" in downs[0].reason and "-9" in downs[0].reason
        assert not pid_alive(pid)


async def test_telemetry_is_published_and_labelled_simulated(make_agent, bus, subjects, state):
    seen = await collect(bus, subjects.gpu_telemetry("*"), GpuTelemetry)
    agent = make_agent()
    async with running(agent):
        reply = await bus.request(subjects.agent("sim0", "start"), start_req(), AgentReply, timeout=5)
        await wait_for(lambda: any(t.workers for t in seen), timeout=5, what="telemetry with a worker")
        t = [t for t in seen if t.workers][-1]
        assert t.gpu_id == "sim0" and t.simulated is True and "Simulated" in t.name
        assert t.workers == reply.started and t.power_w > 0 and t.max_sm_clock_mhz > 0
        stored = await state.get_json(state.keys.gpu("sim0"), GpuTelemetry)
        assert stored is not None and stored.simulated is True
        info = (await state.live_agents())[0]
        assert info.simulated is True and info.pid == os.getpid()
        assert info.control_subject == subjects.agent("sim0", "*")
