"""The predictor service: `polyserve.v1.predict` plus learning from `completed` events."""
from __future__ import annotations

import asyncio
import logging
from typing import Any


from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.handlers import LengthStats, PredictHandlers
from polyserve.proto import Completed, PredictRequest
from polyserve.shared.lifecycle import ServiceBase

logger = logging.getLogger(__name__)

QUEUE = "predictor"
LEARN_QUEUE = "predictor-learn"


class PredictorService(ServiceBase):
    """Aladdin §2.3 historical conditional mean behind `polyserve.v1.predict`."""

    name = "predictor"
    settings: PredictorSettings

    def __init__(self, settings: PredictorSettings, **kw: Any):
        super().__init__(settings, **kw)
        self.stats: LengthStats = None  # type: ignore[assignment]  # set in on_start
        self.handlers: PredictHandlers = None  # type: ignore[assignment]

    async def on_start(self) -> None:
        """Load nothing up front (models are loaded on first use); subscribe; start the refresh loop."""
        s = self.settings
        self.stats = LengthStats(self.state.r, self.keys, timeout_s=s.redis_timeout_s,
                                 retry_s=s.redis_retry_s, max_models=s.max_models)
        self.handlers = PredictHandlers(s, self.stats)
        await self.bus.serve(self.subjects.predict, PredictRequest, self.handlers.predict, queue=QUEUE)
        # A queue group: with several predictors sharing the Redis statistics,
        # each completed request must be counted once, by one of them.
        await self.bus.listen(self.subjects.event("completed"), Completed, self.handlers.on_completed,
                              queue=LEARN_QUEUE)
        self.background(self._refresh_loop(), "refresh")

    async def _refresh_loop(self) -> None:
        """Write buffered observations and re-read the statistics every `refresh_s`."""
        # Also ends on the stop event: a cancellation swallowed inside a Redis
        # call (seen with redis-py on Python 3.11) must not keep it alive.
        while not self.stop_event.is_set():
            await asyncio.sleep(self.settings.refresh_s)
            try:
                await self.stats.flush()
                await self.stats.refresh()
            except Exception:
                logger.exception("predictor: refreshing length statistics failed")

    async def on_drain(self, timeout: float) -> None:
        """Stop learning and save what is still buffered (bounded by `timeout`)."""
        if self.stats is None:
            return
        try:
            saved = await asyncio.wait_for(self.stats.flush(), timeout)
        except asyncio.TimeoutError:
            saved = False
        if not saved:
            logger.warning("predictor: %d models' observations could not be saved to Redis before stop",
                           len(self.stats.pending))
