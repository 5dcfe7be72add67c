"""The planner stops a worker for an explicit delete only, never because Redis came back
empty (issue 13), and re-applies its desired-state file when Redis holds no deployment.
Real nats-server and redis-server; the stand-in gpu-agent of test_planner.py."""
import time

import pytest

from polyserve.planner.reconcile import EPOCH_KEY, DesiredStateKeeper
from polyserve.planner.service import PlannerService
from polyserve.proto import StopWorker
from tests.helpers import running, wait_for
from tests.integration.test_planner import FakeAgent, deployment, planner_settings

pytestmark = pytest.mark.integration


async def _wipe(state) -> None:
    """What a Redis restart without persistence does to this test's keys."""
    keys = [k async for k in state.r.scan_iter(f"{state.keys.prefix}:*")]
    if keys:
        await state.r.delete(*keys)


async def test_explicit_delete_stops_workers_data_loss_does_not(make_settings, bus, subjects, state):
    await state.put_deployment(deployment("d1"))
    await state.put_deployment(deployment("d2"))
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1", "w-b": "d2"}).serve()
    planner = PlannerService(planner_settings(make_settings))
    async with running(planner):
        await wait_for(lambda: {"d1", "d2"} <= set(planner.decisions), what="the reconcile at start")
        assert await state.r.get(EPOCH_KEY.format(prefix=state.keys.prefix))

        await _wipe(state)  # Redis lost everything: the planner's reads come back empty
        await agent.publish()  # the agent re-registers, still hosting both workers
        for _ in range(3):
            assert await planner.tick() == []
        assert agent.stops == [] and sorted(agent.workers) == ["w-a", "w-b"]

        await state.put_deployment(deployment("d1"))  # re-applied (POST or desired-state file)
        await state.put_deployment(deployment("d2"))
        await planner.tick()
        await state.delete_deployment("d2")  # an explicit delete of a deployment the planner saw
        await planner.tick()
        assert agent.stops == [StopWorker(deployment="d2", count=1)]
        assert list(agent.workers) == ["w-a"]


async def test_never_seen_deployment_stopped_after_grace(make_settings, bus, subjects, state):
    await state.put_deployment(deployment("d1"))
    agent = await FakeAgent(bus, subjects, state, "g0", {"w-a": "d1", "w-x": "gone"}).serve()
    planner = PlannerService(planner_settings(make_settings, orphan_grace_s=0.2))
    async with running(planner):
        await wait_for(lambda: "d1" in planner.decisions, what="the reconcile at start")
        assert agent.stops == []
        await wait_for(lambda: planner.orphans.absent_since.get("gone", 1e18) + 0.2 < time.time(),
                       what="the grace to pass")
        await planner.tick()
        assert agent.stops == [StopWorker(deployment="gone", count=1)]


async def test_desired_state_file_reapplied_when_redis_is_empty(make_settings, bus, subjects, state, tmp_path):
    path = tmp_path / "desired.yaml"
    path.write_text("deployments:\n  - id: chat\n    model: m1\n    scaler: {min_replicas: 0, max_replicas: 2}\n")
    keeper = DesiredStateKeeper(str(path), state)
    assert await keeper.ensure() == 1
    assert (await state.get_deployment("chat")).scaler.max_replicas == 2
    assert await keeper.ensure() == 0  # Redis has a deployment: nothing to do

    planner = PlannerService(planner_settings(make_settings, desired_state_file=str(path),
                                              desired_state_interval_s=0.05))
    async with running(planner):
        await _wipe(state)
        await wait_for(lambda: state.get_deployment("chat"), timeout=5, what="the file re-applied")
        path.write_text("deployments:\n  - id: chat\n    model: m1\n    scaler: {min_replicas: -1}\n")
        await _wipe(state)  # an invalid edit: the last valid version is applied
        await wait_for(lambda: state.get_deployment("chat"), timeout=5, what="the last valid version re-applied")
