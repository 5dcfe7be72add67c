"""Event handlers of the planner: completed requests feed the windows, heartbeats say
which workers are up and how busy, scale signals go to the planner's decision. They
write into a `PlannerState` and call back for signals; they never reach into the
service. Handlers never raise into the bus; bad events are skipped."""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from polyserve.planner.policy import Sample
from polyserve.planner.state import PlannerState
from polyserve.proto import Completed, Heartbeat, ScaleSignal, WorkerDown

logger = logging.getLogger(__name__)


class PlannerHandlers:
    """Event handlers bound to one planner's state and its signal decision."""

    def __init__(self, state: PlannerState, on_signal: Callable[[ScaleSignal], Awaitable[object]],
                 clock: Callable[[], float] = time.time):
        self.state = state
        self.on_signal = on_signal
        self.clock = clock

    async def on_completed(self, ev: Completed) -> None:
        """Add the request to its deployment's window (timestamped on receipt, in the
        planner's clock, so clock skew between hosts cannot move it out of a window)."""
        if not ev.deployment:
            logger.debug("completed event %s has no deployment; ignored", ev.request_id)
            return
        sample = Sample(ts=self.clock(), e2e_ms=ev.e2e_ms, output_tokens=ev.output_tokens, ttft_ms=ev.ttft_ms)
        self.state.add_completed(ev.deployment, sample, ev.input_tokens)

    async def on_scale_signal(self, sig: ScaleSignal) -> None:
        """A request for one more worker (dispatcher or MIAD); the planner decides."""
        try:
            await self.on_signal(sig)
        except Exception:  # noqa: BLE001 - Redis/NATS briefly down: the next signal retries
            logger.exception("scale signal for %s from %s failed", sig.deployment, sig.source)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        self.state.heartbeat(hb, self.clock())

    async def on_worker_down(self, ev: WorkerDown) -> None:
        self.state.worker_down(ev.worker_id)
