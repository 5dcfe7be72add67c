"""The planner with the Kubernetes actuator, against real nats-server and redis-server and a
fake AppsV1Api (the contract fake of tests/unit/test_k8s_contract.py): the replica count
comes from the Deployment's scale and the decision is patched back."""
import time

import pytest

from polyserve.planner.config import PlannerSettings
from polyserve.planner.k8s import KubernetesActuator
from polyserve.planner.service import PlannerService
from polyserve.proto import Heartbeat
from tests.helpers import running, wait_for
from tests.integration.test_planner import THRESHOLD_MS, deployment, publish_completed

pytest.importorskip("kubernetes", reason="the contract fake returns the client's models")
from tests.unit.test_k8s_contract import FakeAppsV1Api

pytestmark = pytest.mark.integration


async def test_planner_scales_the_kubernetes_deployment(make_settings, bus, subjects, state):
    await state.put_deployment(deployment("d1"))
    for wid in ("w-a", "w-b"):  # the two pods' workers heartbeat into Redis
        await state.put_worker(Heartbeat(worker_id=wid, deployment="d1", model="m1", engine="sim", ttl_s=60))
    apps = FakeAppsV1Api(replicas=2)
    planner = PlannerService(make_settings(PlannerSettings, "planner", poll_interval_s=3600.0,
                                           scale_down_stabilization_s=0.0, worker_start_grace_s=60.0,
                                           actuator="kubernetes", k8s_namespace="ns"))
    planner.k8s = KubernetesActuator(apps, "ns")  # injected: no cluster here
    async with running(planner):
        await wait_for(lambda: planner.decisions.get("d1"), what="the reconcile at start")
        assert (planner.decisions["d1"].current, planner.decisions["d1"].desired) == (2, 2)
        assert [c[0] for c in apps.calls] == ["read_namespaced_deployment_scale"]

        await publish_completed(bus, subjects, "d1", per_token_ms=2 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 5, what="completed events")
        [d] = await planner.tick()
        assert (d.current, d.desired) == (2, 3) and "kubernetes replicas -> 3" in d.reason
        patch = apps.calls[-1]
        assert patch[0] == "patch_namespaced_deployment_scale"
        assert patch[2]["name"] == "polyserve-worker-d1" and patch[2]["body"] == {"spec": {"replicas": 3}}

        await publish_completed(bus, subjects, "d1", per_token_ms=2 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 10, what="completed events")
        [d] = await planner.tick()  # 3 replicas, 2 serving: the third pod is still starting
        assert (d.current, d.desired) == (3, 3)

        planner.memory.last_change["d1"] = time.time()  # only what follows counts (reset_window_on_scale)
        await publish_completed(bus, subjects, "d1", per_token_ms=0.1 * THRESHOLD_MS)
        await wait_for(lambda: planner.sample_count("d1") == 15, what="completed events")
        [d] = await planner.tick()
        assert d.desired < 3 and apps.replicas == d.desired
