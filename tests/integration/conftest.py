"""A whole control plane in this test's event loop: predictor, dispatcher, a sim
worker and the gateway, on the session nats-server and redis-server."""
from __future__ import annotations

import contextlib

import openai
import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.service import GatewayService
from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.service import PredictorService
from polyserve.proto import Deployment, GenerateRequest, ScalerPolicy
from polyserve.worker.config import WorkerSettings
from polyserve.worker.service import WorkerService
from tests.helpers import running

MODEL = "sim-test"


@pytest.fixture
def plane(make_settings, state, span_exporter):
    """Async context factory: `async with plane(**gateway_overrides) as p:` -> p.gateway, p.client."""

    @contextlib.asynccontextmanager
    async def start(with_worker: bool = True, with_predictor: bool = True, worker_kw: dict | None = None,
                    **gw_kw):
        await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="least_outstanding",
                                              scaler=ScalerPolicy(min_replicas=1, max_replicas=1)))
        gw_kw.setdefault("port", 0)
        gateway = GatewayService(make_settings(GatewaySettings, "gateway", **gw_kw), span_exporter=span_exporter)
        services = []
        if with_predictor:
            services.append(PredictorService(make_settings(PredictorSettings, "predictor", proxy_artifact=""),
                                             span_exporter=span_exporter))
        services.append(DispatcherService(make_settings(DispatcherSettings, "dispatcher"),
                                          span_exporter=span_exporter))
        worker = None
        if with_worker:
            wkw = dict(worker_id="w-test", deployment=MODEL, model=MODEL, engine="sim", time_scale=0.01,
                       heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0)
            wkw.update(worker_kw or {})
            worker = WorkerService(make_settings(WorkerSettings, "worker", **wkw), span_exporter=span_exporter)
            services.append(worker)
        services.append(gateway)
        async with running(*services):
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                                        timeout=20)

            class P:
                pass

            p = P()
            p.gateway, p.client, p.worker, p.url, p.services = gateway, client, worker, gateway.url, services
            yield p
            await client.close()

    return start


async def placements(bus, subjects, worker_ids) -> dict[str, str]:
    """request id -> the worker its generate request was sent to, filled as they are sent."""
    where: dict[str, str] = {}
    for wid in worker_ids:
        async def on_generate(req: GenerateRequest, wid=wid):
            where[req.request_id] = wid
        await bus.listen(subjects.generate(wid), GenerateRequest, on_generate)
    await bus.nc.flush()
    return where


def sim_fleet(make_settings, worker_ids, time_scale: float = 0.2, **gateway) -> tuple[GatewayService, list]:
    """A gateway (`gateway`: its settings), a predictor, a dispatcher and one sim worker per id
    (deployment MODEL, fast heartbeats): (gateway, every service, to start with `running`)."""
    workers = [WorkerService(make_settings(WorkerSettings, "worker", worker_id=wid, deployment=MODEL, model=MODEL,
                                           engine="sim", time_scale=time_scale, heartbeat_interval_s=0.2,
                                           heartbeat_ttl_s=1.0)) for wid in worker_ids]
    gw = GatewayService(make_settings(GatewaySettings, "gateway", port=0, **gateway))
    return gw, [PredictorService(make_settings(PredictorSettings, "predictor", proxy_artifact="")),
                DispatcherService(make_settings(DispatcherSettings, "dispatcher")), *workers, gw]
