"""The planner against real nats-server and redis-server, with a stand-in gpu-agent
served from the test's own bus connection that records what the planner asks."""
import time

import pytest

from polyserve.planner import autoscalers
from polyserve.planner.config import PlannerSettings
from polyserve.planner.service import NO_AGENT, PlannerService
from polyserve.proto import (
    AgentInfo,
    AgentReply,
    Completed,
    Deployment,
    Heartbeat,
    ScaleDecision,
    ScalerPolicy,
    ScaleSignal,
    StartWorker,
    StopWorker,
)
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration

THRESHOLD_MS = 20.0  # per token


class FakeAgent:
    """Answers start/stop like a gpu-agent and keeps its AgentInfo in Redis."""

    def __init__(self, bus, subjects, state, gpu_id, workers):
        self.bus, self.subjects, self.state, self.gpu_id = bus, subjects, state, gpu_id
        self.workers = dict(workers)
        self.starts: list[StartWorker] = []
        self.stops: list[StopWorker] = []

    async def publish(self):
        await self.state.put_agent(AgentInfo(gpu_id=self.gpu_id, simulated=True, workers=self.workers,
                                             control_subject=self.subjects.agent(self.gpu_id, "*")), 60)

    async def serve(self):
        await self.bus.serve(self.subjects.agent(self.gpu_id, "start"), StartWorker, self.on_start)
        await self.bus.serve(self.subjects.agent(self.gpu_id, "stop"), StopWorker, self.on_stop)
        await self.bus.nc.flush()
        await self.publish()
        return self

    async def on_start(self, req):
        self.starts.append(req)
        ids = [f"w-new{len(self.workers) + i}" for i in range(req.count)]
        self.workers.update({w: req.deployment for w in ids})
        await self.publish()
        return AgentReply(gpu_id=self.gpu_id, started=ids)

    async def on_stop(self, req):
        self.stops.append(req)
        ids = [w for w, d in self.workers.items() if d == req.deployment][-req.count:]
        for w in ids:
            del self.workers[w]
        await self.publish()
        return AgentReply(gpu_id=self.gpu_id, stopped=ids)


def deployment(dep_id="d1"):
    return Deployment(id=dep_id, model="m1", engine="sim",
                      scaler=ScalerPolicy(type="pertoken", min_replicas=1, max_replicas=3,
                                          window_s=30.0, threshold_ms=THRESHOLD_MS))


async def publish_completed(bus, subjects, dep_id, per_token_ms, n=5, tokens=10):
    for i in range(n):
        await bus.publish(subjects.event("completed"), Completed(
            request_id=f"r{time.monotonic_ns()}-{i}", deployment=dep_id, model="m1", worker_id="w-a",
            input_tokens=8, output_tokens=tokens, e2e_ms=per_token_ms * tokens, ttft_ms=5.0))
    await bus.nc.flush()


def planner_settings(make_settings, **kw):
    base = dict(poll_interval_s=3600.0, scale_down_stabilization_s=0.0, worker_start_grace_s=0.0)
    base.update(kw)
    return make_settings(PlannerSettings, "planner", **base)


async def test_scales_out_on_high_per_token_latency_and_in_on_low(make_settings, bus, subjects, state):
    dep = deployment()
    await state.put_deployment(dep)
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1", "w-b": "d1"}).serve()
    decisions: list[ScaleDecision] = []

    async def on_decision(d):
        decisions.append(d)

    await bus.listen(subjects.scale("d1"), ScaleDecision, on_decision)
    await bus.nc.flush()
    planner = PlannerService(planner_settings(make_settings))
    async with running(planner):
        await wait_for(lambda: decisions, what="the reconcile at start")
        assert (decisions[0].current, decisions[0].desired, decisions[0].samples) == (2, 2, 0)
        assert agent.starts == [] and agent.stops == []

        await publish_completed(bus, subjects, "d1", per_token_ms=2 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 5, what="completed events")
        [d] = await planner.tick()  # ceil(2 × 2) = 4, clamped to max_replicas 3
        assert (d.current, d.desired, d.scaler, d.samples) == (2, 3, "pertoken", 5)
        assert d.metric_ms == pytest.approx(2 * THRESHOLD_MS) and d.threshold_ms == THRESHOLD_MS
        assert agent.starts == [StartWorker(deployment="d1", model="m1", engine="sim", count=1)]
        await wait_for(lambda: decisions[-1].desired == 3, what="published decision")
        assert (await state.get_json(state.keys.plan("d1"), ScaleDecision)).desired == 3

        [d] = await planner.tick()  # the samples predate the scale-out: hold, no double start
        assert (d.current, d.desired) == (3, 3) and len(agent.starts) == 1

        await publish_completed(bus, subjects, "d1", per_token_ms=0.2 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 10, what="low-latency events")
        [d] = await planner.tick()  # ceil(3 × 0.2) = 1
        assert (d.current, d.desired) == (3, 1)
        assert agent.stops == [StopWorker(deployment="d1", count=2)]
        assert list(agent.workers) == ["w-a"]


async def test_doubles_from_one_worker(make_settings, bus, subjects, state):
    await state.put_deployment(deployment())
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1"}).serve()
    planner = PlannerService(planner_settings(make_settings))
    async with running(planner):
        await wait_for(lambda: "d1" in planner.decisions, what="the reconcile at start")
        await publish_completed(bus, subjects, "d1", per_token_ms=2 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 5, what="completed events")
        [d] = await planner.tick()
        assert (d.current, d.desired) == (1, 2)
        assert [s.count for s in agent.starts] == [1]
        assert type(planner.memory.scalers["d1"][0]) is autoscalers.HpaScaler  # the simulator's scaler object


async def test_no_agent_decision_says_so(make_settings, bus, subjects, state):
    await state.put_deployment(deployment())
    planner = PlannerService(planner_settings(make_settings))
    async with running(planner):
        await wait_for(lambda: "d1" in planner.decisions, what="the reconcile at start")
        d = planner.decisions["d1"]
        assert (d.current, d.desired) == (0, 1) and d.reason.startswith(NO_AGENT)
        assert (await state.get_json(state.keys.plan("d1"), ScaleDecision)).reason.startswith(NO_AGENT)


async def test_start_at_once_gate_on_starting_workers_and_orphans(make_settings, bus, subjects, state):
    await state.put_deployment(deployment())
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-x": "deleted-dep"}).serve()
    planner = PlannerService(planner_settings(make_settings, worker_start_grace_s=60.0))
    async with running(planner):
        # the reconcile at start: min_replicas for d1; the worker of a deployment this planner never saw
        # in Redis is left alone (Redis may have lost its data; test_planner_orphans.py has the deletes)
        await wait_for(lambda: agent.starts, what="start")
        await planner.tick()  # the start's round is over (the lock), and a second one stops nothing either
        assert agent.starts == [StartWorker(deployment="d1", model="m1", engine="sim", count=1)]
        assert agent.stops == []
        [new] = [w for w, d in agent.workers.items() if d == "d1"]

        await publish_completed(bus, subjects, "d1", per_token_ms=3 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 5, what="completed events")
        [d] = await planner.tick()  # the new worker has not heartbeated: no further scale-out yet
        assert (d.current, d.desired) == (1, 1) and "starting worker" in d.reason
        await bus.publish(subjects.worker_event("heartbeat"),
                          Heartbeat(worker_id=new, deployment="d1", model="m1", engine="sim"))
        await wait_for(lambda: new in planner.memory.heartbeats, what="heartbeat")
        [d] = await planner.tick()
        assert (d.current, d.desired) == (1, 3) and agent.starts[-1].count == 2


# --------------------------------------------------------------------------- target tracking (Arlo §4), live
async def test_target_tracking_live_steps_the_same_scaler_as_the_simulator(make_settings, bus, subjects, state,
                                                                         monkeypatch):
    slo_ms = 100.0  # P98 request latency
    await state.put_deployment(Deployment(id="d1", model="m1", engine="sim", scaler=ScalerPolicy(
        type="tracking", min_replicas=1, max_replicas=3, window_s=30.0, threshold_ms=slo_ms)))  # an alias
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1", "w-b": "d1"}).serve()
    steps: list[autoscalers.Observation] = []
    step = autoscalers.TargetTracking.step

    def spy(self, st, obs):
        steps.append(obs)
        return step(self, st, obs)

    monkeypatch.setattr(autoscalers.TargetTracking, "step", spy)
    planner = PlannerService(planner_settings(make_settings, tracking_hold_s=0.0))
    async with running(planner):
        await wait_for(lambda: "d1" in planner.decisions, what="the reconcile at start")
        d = planner.decisions["d1"]  # no sample, no worker load known yet: not idle, hold
        assert (d.current, d.desired, d.scaler) == (2, 2, "target_tracking") and "holding 2" in d.reason
        assert steps[-1].current == 2 and steps[-1].samples == []
        for w in ("w-a", "w-b"):
            await bus.publish(subjects.worker_event("heartbeat"), Heartbeat(
                worker_id=w, deployment="d1", model="m1", engine="sim", running=1, waiting=int(w == "w-b")))
        await wait_for(lambda: {"w-a", "w-b"} <= planner.memory.loads.keys(), what="heartbeats")

        await publish_completed(bus, subjects, "d1", per_token_ms=20.0)  # 200 ms >= 0.95 x SLO
        await wait_for(lambda: planner.sample_count("d1") == 5, what="completed events")
        [d] = await planner.tick()
        assert (d.current, d.desired, d.samples) == (2, 3, 5) and d.metric_ms == pytest.approx(200.0)
        assert "add one worker" in d.reason and agent.starts[-1].count == 1
        assert sorted((w.worker_id, w.load) for w in steps[-1].workers) == [("w-a", 1.0), ("w-b", 2.0)]
        assert type(planner.memory.scalers["d1"][0]) is autoscalers.TargetTracking

        await publish_completed(bus, subjects, "d1", per_token_ms=2.0)  # 20 ms < 0.5 x SLO, hold 0 s
        await wait_for(lambda: planner.sample_count("d1") == 10, what="low-latency events")
        [d] = await planner.tick()  # only the samples after the scale-out count
        assert (d.current, d.desired, d.samples) == (3, 2, 5) and "remove the least busy worker w-a" in d.reason
        assert agent.stops == [StopWorker(deployment="d1", count=1)]


# --------------------------------------------------------------------------- scale signals
async def send_signals(bus, subjects, dep_id, source, n):
    for i in range(n):
        await bus.publish(subjects.scale_signal(dep_id), ScaleSignal(deployment=dep_id, source=source,
                                                                     reason=f"burst {i}", gpu_id="g0"))
    await bus.nc.flush()


async def test_scale_signal_burst_starts_one_worker_then_waits_then_stops_at_max(make_settings, bus, subjects,
                                                                                 state):
    await state.put_deployment(Deployment(id="d1", model="m1", engine="sim", scaler=ScalerPolicy(
        type="muserve", min_replicas=1, max_replicas=3, threshold_ms=THRESHOLD_MS)))
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1"}).serve()
    decisions: list[ScaleDecision] = []

    async def on_decision(d):
        decisions.append(d)

    await bus.listen(subjects.scale("d1"), ScaleDecision, on_decision)
    planner = PlannerService(planner_settings(make_settings, signal_cooldown_s=0.5, worker_start_grace_s=60.0))
    async with running(planner):
        await wait_for(lambda: decisions, what="the reconcile at start")
        assert (decisions[0].current, decisions[0].desired, decisions[0].scaler) == (1, 1, "muserve")
        await publish_completed(bus, subjects, "d1", per_token_ms=5 * THRESHOLD_MS)  # no HPA for signal types
        await wait_for(lambda: planner.sample_count("d1") == 5, what="completed events")
        [d] = await planner.tick()
        assert (d.current, d.desired) == (1, 1) and agent.starts == []
        await bus.publish(subjects.worker_event("heartbeat"),
                          Heartbeat(worker_id="w-a", deployment="d1", model="m1", engine="sim"))
        await wait_for(lambda: "w-a" in planner.memory.heartbeats, what="heartbeat")  # w-a serves: not pending

        await send_signals(bus, subjects, "d1", "aladdin", 2)  # a source muserve does not honour
        await send_signals(bus, subjects, "d1", "miad", 6)  # a burst
        await wait_for(lambda: planner.memory.signals.get("d1", [0])[0] == 8, what="signals received")
        assert agent.starts == [StartWorker(deployment="d1", model="m1", engine="sim", count=1)]
        assert planner.memory.signals["d1"] == [8, 1]
        await wait_for(lambda: decisions[-1].desired == 2, what="published decision")
        d = decisions[-1]
        assert (d.current, d.desired, d.scaler) == (1, 2, "muserve") and "scale signal from miad" in d.reason
        assert (await state.get_json(state.keys.plan("d1"), ScaleDecision)).desired == 2

        await wait_for(lambda: time.time() - planner.memory.last_change["d1"] > 0.5,
                       what="the signal cooldown (0.5 s) to pass")  # the new worker has not heartbeated -> pending
        [new] = [w for w in agent.workers if w != "w-a"]
        assert await planner.handle_signal(ScaleSignal(deployment="d1", source="miad")) is None
        await bus.publish(subjects.worker_event("heartbeat"),
                          Heartbeat(worker_id=new, deployment="d1", model="m1", engine="sim"))
        await wait_for(lambda: new in planner.memory.heartbeats, what="heartbeat")
        d = await planner.handle_signal(ScaleSignal(deployment="d1", source="miad"))
        assert (d.current, d.desired) == (2, 3) and len(agent.starts) == 2
        await wait_for(lambda: time.time() - planner.memory.last_change["d1"] > 0.5,
                       what="the signal cooldown (0.5 s) to pass")
        for w in [w for w in agent.workers if w not in planner.memory.heartbeats]:
            planner.memory.heartbeats[w] = time.time()  # serving (heartbeat bookkeeping as on_heartbeat does)
        d = await planner.handle_signal(ScaleSignal(deployment="d1", source="miad"))
        assert (d.current, d.desired) == (3, 3) and "at max_replicas=3" in d.reason and len(agent.starts) == 2


async def test_hpa_deployments_ignore_scale_signals(make_settings, bus, subjects, state):
    await state.put_deployment(deployment())  # pertoken
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1"}).serve()
    planner = PlannerService(planner_settings(make_settings, signal_cooldown_s=0.0))
    async with running(planner):
        await wait_for(lambda: "d1" in planner.decisions, what="the reconcile at start")
        await send_signals(bus, subjects, "d1", "miad", 3)
        await send_signals(bus, subjects, "d1", "aladdin", 3)
        await wait_for(lambda: planner.memory.signals.get("d1", [0])[0] == 6, what="signals received")
        assert planner.memory.signals["d1"] == [6, 0] and agent.starts == []
