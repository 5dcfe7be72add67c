"""The gateway's /metrics carries what the dashboards plot (infra/grafana): ATGT, queue time,
predictions by source and output tokens of its own requests; and, from NATS, live workers and
their load and LoRA tiers (heartbeats), GPU power/clock/energy (GpuTelemetry, EnergyReport)
and scale decisions (ScaleDecision)."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polyserve.proto import AdapterInfo, EnergyReport, GpuTelemetry, Heartbeat, ScaleDecision
from tests.helpers import wait_for
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration


async def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics")).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    return sum(found) if found else None


async def test_metrics_for_the_dashboards(plane, bus, subjects):
    async with plane() as p:
        hb = Heartbeat(worker_id="w-dash", deployment="dash-dep", model="dash-model", engine="sim", gpu_id="g-dash",
                       running=3, waiting=2, ttl_s=30.0, simulated=True,
                       adapters=[AdapterInfo(name="a1", rank=8, tier="gpu"), AdapterInfo(name="a2", rank=8,
                                                                                         tier="host")])
        await bus.publish(subjects.worker_event("heartbeat"), hb)
        await bus.publish(subjects.gpu_telemetry("g-dash"), GpuTelemetry(
            gpu_id="g-dash", name="sim", simulated=True, power_w=250.5, energy_j=1234.0, sm_clock_mhz=1410,
            mem_clock_mhz=1593))
        await bus.publish(subjects.gpu_energy("g-dash"), EnergyReport(
            gpu_id="g-dash", window_s=5.0, energy_j=100.0, source="model", simulated=True, requests=2,
            tokens=60, output_tokens=50, j_per_token=2.0))
        await bus.publish(subjects.scale("dash-dep"), ScaleDecision(
            deployment="dash-dep", scaler="pertoken", current=1, desired=2, threshold_ms=75.0))
        await bus.nc.flush()

        c = await p.client.completions.create(model=MODEL, prompt="hello there", max_tokens=6,
                                              extra_body={"min_tokens": 6})
        assert c.usage.completion_tokens == 6

        async def ready():
            s = await scrape(p.url)
            # a request's series follow its `completed` event, which may come after its response
            # (a prediction asked in a batch is waited for first: gateway/predict_batch.py)
            return value(s, "polyserve_atgt_seconds_count", deployment=MODEL) and \
                value(s, "polyserve_scale_decisions_total", deployment="dash-dep", direction="up") and \
                value(s, "polyserve_gpu_energy_per_output_token_joules", gpu_id="g-dash") is not None and \
                value(s, "polyserve_workers", deployment="dash-dep") and \
                value(s, "polyserve_workers", deployment=MODEL)  # heartbeats: late under load (CI, once)
        await wait_for(ready, what="fleet metrics on /metrics")
        s = await scrape(p.url)

    assert value(s, "polyserve_atgt_seconds_count", deployment=MODEL) == 1
    assert value(s, "polyserve_queue_seconds_count", deployment=MODEL) == 1
    assert value(s, "polyserve_output_tokens_total", deployment=MODEL) == 6
    assert value(s, "polyserve_predictions_total", deployment=MODEL) == 1
    assert value(s, "polyserve_workers", deployment=MODEL) == 1  # the plane's sim worker
    assert value(s, "polyserve_workers", deployment="dash-dep") == 1
    assert value(s, "polyserve_worker_running", deployment="dash-dep") == 3
    assert value(s, "polyserve_worker_waiting", deployment="dash-dep") == 2
    assert value(s, "polyserve_lora_adapters", deployment="dash-dep", tier="gpu") == 1
    assert value(s, "polyserve_lora_adapters", deployment="dash-dep", tier="host") == 1
    assert value(s, "polyserve_gpu_power_watts", gpu_id="g-dash") == 250.5
    assert value(s, "polyserve_gpu_sm_clock_mhz", gpu_id="g-dash") == 1410
    assert value(s, "polyserve_gpu_energy_joules", gpu_id="g-dash") == 1234.0
    assert value(s, "polyserve_gpu_energy_per_output_token_joules", gpu_id="g-dash") == 2.0
    assert value(s, "polyserve_scale_decisions_total", deployment="dash-dep", direction="up") == 1
    # bounded labels: no request or worker ids anywhere
    assert not any(k in dict(lab) for (_, lab) in s for k in ("request_id", "worker_id"))
