"""The planner never loops over a replica count it read from Redis unchecked (issue 14): a
deployment written straight into Redis with min = max = 10^9 is clamped to max_replicas_limit and
started in bounded batches; the planner keeps its registry entry and scales the other deployments."""
from __future__ import annotations

import time

import pytest

from polyserve.planner.service import PlannerService
from polyserve.proto import Deployment, ScalerPolicy
from tests.helpers import running, wait_for
from tests.integration.test_planner import FakeAgent, deployment, planner_settings

pytestmark = pytest.mark.integration


async def test_huge_replica_count_in_redis_does_not_stall_the_planner(make_settings, bus, subjects, state):
    huge = Deployment(id="huge", model="m-huge", engine="sim",
                      scaler=ScalerPolicy(type="pertoken", min_replicas=10**9, max_replicas=10**9))
    await state.put_deployment(huge)
    await state.put_deployment(deployment("d1"))  # min 1: wants one worker
    agent = await FakeAgent(bus, subjects, state, "g0", {}).serve()
    planner = PlannerService(planner_settings(make_settings, max_replicas_limit=50, max_starts_per_tick=8,
                                              service_ttl_s=1.0))
    async with running(planner):
        await wait_for(lambda: {"huge", "d1"} <= set(planner.decisions), what="the reconcile at start")
        t0 = time.monotonic()
        for _ in range(3):
            await planner.tick()
        assert time.monotonic() - t0 < 5
        huge_starts = [s.count for s in agent.starts if s.deployment == "huge"]
        assert huge_starts and max(huge_starts) <= 8 and sum(huge_starts) <= 4 * 8
        assert planner.decisions["huge"].desired <= 50
        assert any(s.deployment == "d1" for s in agent.starts)  # the other deployment still scales
        for _ in range(10):
            await planner.tick()
        assert sum(s.count for s in agent.starts if s.deployment == "huge") == 50  # the limit, no more
        live = {s.service for s in await state.live_services()}
        assert "planner" in live  # its registry entry never expired
