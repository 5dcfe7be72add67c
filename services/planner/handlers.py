"""Event handlers of the planner: completed requests feed the windows, heartbeats say
which workers are up. Handlers never raise into the bus; bad events are skipped."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from polyserve.planner.policy import Sample, Window
from polyserve.proto import Completed, Heartbeat, ScaleSignal, WorkerDown

if TYPE_CHECKING:
    from polyserve.planner.service import PlannerService

logger = logging.getLogger(__name__)


class PlannerHandlers:
    """Event handlers bound to one planner."""

    def __init__(self, planner: "PlannerService"):
        self.planner = planner

    async def on_completed(self, ev: Completed) -> None:
        """Add the request to its deployment's window (timestamped on receipt, in the
        planner's clock, so clock skew between hosts cannot move it out of a window)."""
        if not ev.deployment:
            logger.debug("completed event %s has no deployment; ignored", ev.request_id)
            return
        p = self.planner
        window = p.windows.get(ev.deployment)
        if window is None:
            window = p.windows[ev.deployment] = Window(p.settings.max_samples)
        now = time.time()
        window.add(Sample(ts=now, e2e_ms=ev.e2e_ms, output_tokens=ev.output_tokens,
                          ttft_ms=ev.ttft_ms))
        if ev.deployment in p.other_deployments:
            return  # only encoder deployments (and ones not classified yet) keep lengths
        lengths = p.lengths.get(ev.deployment)
        if lengths is None:
            lengths = p.lengths[ev.deployment] = deque(maxlen=10 * p.settings.max_samples)
        lengths.append((now, max(0, ev.input_tokens)))  # Arlo's per-bin demand

    async def on_scale_signal(self, sig: ScaleSignal) -> None:
        """A request for one more worker (dispatcher or MIAD); the planner decides."""
        try:
            await self.planner.handle_signal(sig)
        except Exception:  # noqa: BLE001 - Redis/NATS briefly down: the next signal retries
            logger.exception("scale signal for %s from %s failed", sig.deployment, sig.source)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        self.planner.heartbeats[hb.worker_id] = time.time()

    async def on_worker_down(self, ev: WorkerDown) -> None:
        self.planner.heartbeats.pop(ev.worker_id, None)
