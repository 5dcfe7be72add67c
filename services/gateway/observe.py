"""What the gateway exports beyond its own request counters (metrics.py), for the dashboards.

* Its own request events, tapped where it publishes them (`GatewayState.event`): ATGT, queue
  time, output tokens and prediction error of `completed`, predictions by source of `predicted`.
  Only this gateway's requests, so the series sum over gateways like `polyserve_requests_total`.
* Fleet events every gateway hears alike (take `max` over gateways): `ScaleDecision` on
  `<p>.v1.events.plan.scale.*`, `GpuTelemetry` on `<p>.v1.telemetry.gpu.*`, `EnergyReport` on
  `<p>.v1.telemetry.energy.*`; and, at scrape time, the heartbeats the gateway already caches
  (live workers, running/waiting, LoRA adapters by tier). The gateway's NATS user may
  subscribe `<p>.v1.events.>` and `<p>.v1.telemetry.>` (shared/auth.py)."""
from __future__ import annotations

import time

from polyserve.proto import Completed, EnergyReport, GpuTelemetry, Predicted, ScaleDecision

from .context import GatewayState
from .metrics import FleetCollector


async def start(gs: GatewayState) -> None:
    """Tap the request events, register the scrape-time collector and follow the fleet
    events. Called once by the service, after the bus is connected."""
    m = gs.metrics

    def tap(ev) -> None:  # every event the gateway publishes passes here (GatewayState.emit)
        if isinstance(ev, Completed):
            m.completed(ev.deployment, ev.output_tokens, ev.atgt_ms, ev.queue_ms, ev.predicted_tokens,
                        ev.input_tokens, ev.cached_tokens)
        elif isinstance(ev, Predicted):
            m.predictions.labels(ev.deployment, ev.source).inc()

    gs.taps.append(tap)
    gpus: dict[str, tuple[float, GpuTelemetry]] = {}
    energy: dict[str, tuple[float, EnergyReport]] = {}
    m.registry.register(FleetCollector(gs.fresh_heartbeats, gpus, energy))

    async def on_scale(ev: ScaleDecision) -> None:
        m.scale(ev.deployment, ev.current, ev.desired)

    async def on_gpu(ev: GpuTelemetry) -> None:
        gpus[ev.gpu_id] = (time.monotonic(), ev)

    async def on_energy(ev: EnergyReport) -> None:
        energy[ev.gpu_id] = (time.monotonic(), ev)

    await gs.bus.listen(gs.subjects.scale("*"), ScaleDecision, on_scale)
    await gs.bus.listen(gs.subjects.gpu_telemetry("*"), GpuTelemetry, on_gpu)
    await gs.bus.listen(gs.subjects.gpu_energy("*"), EnergyReport, on_energy)
