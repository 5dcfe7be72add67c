"""Arlo's re-plan loop in the live planner against real nats-server and redis-server, a
gpu-agent on a SIMULATED GPU and real encoder worker processes that replay the shipped
encoder profile (SIMULATED latency, no model loaded): three l512 instances, a short
period of synthetic traffic that is mostly short, and the planner re-loads instances
with the runtimes the ILP chose."""
import collections

import pytest

from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.service import GpuAgentService
from polyserve.planner import arlo_live
from polyserve.planner.config import PlannerSettings
from polyserve.planner.service import PlannerService
from polyserve.proto import AgentReply, Completed, Deployment, RuntimePlan, ScalerPolicy, StartWorker
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PERIOD_S = 2.0
LENGTHS = [40] * 60 + [300] * 10


async def runtimes_live(state, agent):
    """max_input_len -> instances, over the heartbeating workers the agent runs (not stopping)."""
    mine = {w for w, p in agent.workers.items() if not p.stopping}
    hbs = [hb for hb in await state.live_workers() if hb.worker_id in mine]
    return collections.Counter(hb.max_input_len for hb in hbs), len(hbs), len(mine)


async def test_replan_loop_reloads_instances_with_the_planned_runtimes(make_settings, tmp_path, bus, subjects,
                                                                       state):
    rt = arlo_live.load_runtimes(arlo_live.SHIPPED_PROFILE)
    longest = rt.specs[-1]
    await state.put_deployment(Deployment(id="emb", model=MODEL, engine="encoder", policy="least_outstanding",
                                          scaler=ScalerPolicy(min_replicas=3, max_replicas=3)))
    agent = GpuAgentService(make_settings(
        GpuAgentSettings, "gpu-agent", force_simulated=True, miad_enabled=False, worker_log_dir=str(tmp_path),
        telemetry_interval_s=0.5, agent_ttl_s=5.0, watch_interval_s=0.05, max_workers=8, drain_timeout_s=5.0))
    plans: list[RuntimePlan] = []

    async def on_plan(p):
        plans.append(p)

    await bus.listen(subjects.runtime_plan("emb"), RuntimePlan, on_plan)
    async with running(agent):
        reply = await bus.request(subjects.agent(agent.gpu_id, "start"), StartWorker(
            deployment="emb", model=MODEL, engine="encoder", count=3,
            extra_env=arlo_live.runtime_env(longest, str(arlo_live.SHIPPED_PROFILE))), AgentReply, timeout=10)
        assert len(reply.started) == 3

        async def three_l512():
            counts, hbs, _ = await runtimes_live(state, agent)
            return hbs == 3 and counts == {longest.max_length: 3}

        await wait_for(three_l512, timeout=60, what="three l512 encoder workers heartbeating")
        planner = PlannerService(make_settings(PlannerSettings, "planner", poll_interval_s=3600.0,
                                               arlo_period_s=PERIOD_S, worker_start_grace_s=0.0))
        async with running(planner):
            wid = reply.started[0]
            # Start right after a period boundary, so the whole burst lands in one period.
            await wait_for(lambda: plans, timeout=3 * PERIOD_S + 10, what="the first (empty) RuntimePlan")
            n0 = len(plans)
            for i, n in enumerate(LENGTHS):  # what the gateway publishes per embedded input
                await bus.publish(subjects.event("completed"), Completed(
                    request_id=f"e{i}", deployment="emb", model=MODEL, worker_id=wid, input_tokens=n,
                    output_tokens=0, e2e_ms=50.0, ttft_ms=50.0, simulated=True))
            await bus.nc.flush()
            await wait_for(lambda: len(plans) > n0, timeout=3 * PERIOD_S + 10, what="the RuntimePlan of the burst")
            plan = plans[n0]
            expected, _ = arlo_live.compute_plan("emb", {w: len(rt.specs) - 1 for w in reply.started}, rt, LENGTHS,
                                                 PERIOD_S)
            assert plan.counts == expected.counts and plan.previous == expected.previous, (
                plan.counts, expected.counts, plan.previous, expected.previous, plan.reason)
            assert plan.previous[longest.name] == 3 and plan.counts[rt.names[0]] >= 1  # short inputs got a runtime
            assert plan.changes == 3 - plan.counts[longest.name] > 0
            assert plan.applied is True and "applied" in plan.reason, plan.reason
            assert plan.rates[rt.names[0]] == pytest.approx(60 / PERIOD_S)
            want = {s.max_length: plan.counts[s.name] for s in rt.specs if plan.counts[s.name]}

            async def replaced():
                counts, hbs, mine = await runtimes_live(state, agent)
                return hbs == mine == 3 and counts == want

            await wait_for(replaced, timeout=60, what=f"the workers re-loaded as {want}")
            # later periods see the new runtimes (and no traffic: nothing moves)
            await wait_for(lambda: any(p.previous == plan.counts for p in plans[n0 + 1:]), timeout=6 * PERIOD_S + 10,
                           what="a later plan over the new runtimes")
            later = next(p for p in plans[n0 + 1:] if p.previous == plan.counts)
            assert later.changes == 0 and later.counts == plan.counts and "no request" in later.reason
            stored = await state.get_json(state.keys.runtime_plan("emb"), RuntimePlan)
            assert stored.deployment == "emb" and stored in plans
