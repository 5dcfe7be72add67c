"""The predictor service: `polyserve.v1.predict` (and `predict_batch`, several in one message)
plus learning from `completed` events.

Sources, best first: the semantic cache (`cache`), µ-Serve's proxy model
(`model`), Aladdin's historical mean (`history`), the prior (`prior`). The proxy
model loads in a thread after the service is ready; until then, when it cannot
be loaded (no artifact, no `hf` extra), or when a prediction misses its budget,
the historical mean answers. Whatever the source, an estimate never exceeds the
request's `max_tokens` (PredictRequest.max_tokens, when > 0): it is clamped once,
here, and the gateway and dispatcher use it as it is.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.handlers import LengthStats, PredictHandlers
from polyserve.proto import Completed, PredictBatch, PredictRequest
from polyserve.shared.lifecycle import ServiceBase

logger = logging.getLogger(__name__)

QUEUE = "predictor"
LEARN_QUEUE = "predictor-learn"


class PredictorService(ServiceBase):
    """µ-Serve proxy model + semantic cache, with Aladdin §2.3 historical mean as fallback."""

    name = "predictor"
    settings: PredictorSettings

    def __init__(self, settings: PredictorSettings, **kw: Any):
        super().__init__(settings, **kw)
        self.stats: LengthStats = None  # type: ignore[assignment]  # set in on_start
        self.handlers: PredictHandlers = None  # type: ignore[assignment]
        self.runner: Any = None  # proxy.runtime.ModelRunner when a model is configured

    async def on_start(self) -> None:
        """Load nothing up front (models are loaded on first use); subscribe; start the refresh loop."""
        s = self.settings
        self.stats = LengthStats(self.state.r, self.keys, timeout_s=s.redis_timeout_s,
                                 retry_s=s.redis_retry_s, max_models=s.max_models)
        self.runner = self._make_runner()
        self.handlers = PredictHandlers(s, self.stats, self.runner)
        await self.bus.serve(self.subjects.predict, PredictRequest, self.handlers.predict, queue=QUEUE)
        await self.bus.serve(self.subjects.predict_batch, PredictBatch, self.handlers.predict_batch, queue=QUEUE)
        # A queue group: with several predictors sharing the Redis statistics,
        # each completed request must be counted once, by one of them.
        await self.bus.listen(self.subjects.event("completed"), Completed, self.handlers.on_completed,
                              queue=LEARN_QUEUE)
        self.background(self._refresh_loop(), "refresh")
        if self.runner is not None:
            # every instance sees every completed event: each records the requests it predicted
            await self.bus.listen(self.subjects.event("completed"), Completed, self.handlers.on_completed_cache)
            self.background(self._model_loop(), "model")

    def _make_runner(self) -> Any:
        path = self.settings.artifact_dir
        if not path:
            logger.info("predictor: no proxy model configured; answering from the historical mean")
            return None
        from polyserve.predictor.proxy.runtime import ModelRunner

        s = self.settings
        return ModelRunner(path, s.encoder_dir or None, max_batch=s.proxy_max_batch,
                           batch_wait_ms=s.proxy_batch_wait_ms, max_queue=s.proxy_max_queue,
                           bucket_step=s.proxy_bucket_step, threads=s.proxy_threads, cache_keys=s.cache_keys,
                           int8=s.proxy_int8, precision=s.proxy_precision, calibrate=s.proxy_calibrate,
                           device=s.proxy_device)

    async def _model_loop(self) -> None:
        """Load the model (in its thread), then the semantic cache, then keep the cache in sync."""
        await self.runner.start()
        if not self.runner.ready or not self.settings.cache_enabled:
            return
        if not getattr(self.runner.predictor, "dim", 0):
            logger.info("predictor: semantic cache off: the %s tier computes no prompt embedding",
                        self.runner.meta.kind)
            return
        s = self.settings
        try:
            from polyserve.predictor.proxy.cache import RedisCacheStore, SemanticCache
            from polyserve.predictor.proxy.semantic import CacheService

            cache = SemanticCache(self.runner.predictor.dim, threshold=s.cache_threshold,
                                  max_entries=s.cache_max_entries)
        except ImportError as exc:
            logger.warning("predictor: semantic cache off (%s)", exc)
            return
        store = RedisCacheStore(self.state.r, s.prefix, self.runner.predictor.key_space,
                                max_entries=s.cache_max_entries)
        svc = CacheService(cache, store,
                           pending_max=s.cache_pending_max, pending_ttl_s=s.cache_pending_ttl_s,
                           redis_timeout_s=max(s.redis_timeout_s, 0.5))
        self.handlers.cache = svc  # serves from memory at once; Redis entries join as they are read
        first = True
        while not self.stop_event.is_set():
            try:
                n = await svc.sync()
                if first:
                    logger.info("predictor: semantic cache restored %d entries from Redis (key space %s)",
                                n, store.space)
                    first = False
            except Exception as exc:  # noqa: BLE001 - Redis down: the cache keeps working in memory
                logger.warning("predictor: semantic cache sync with Redis failed: %s", exc)
            await self._sleep(s.cache_sync_s)

    async def _sleep(self, seconds: float) -> None:
        try:  # wake at once on stop
            await asyncio.wait_for(self.stop_event.wait(), seconds)
        except asyncio.TimeoutError:
            pass

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
        if self.runner is not None:
            await self.runner.stop()
        if self.stats is None:
            return
        try:
            saved = await asyncio.wait_for(self.stats.flush(), timeout)
        except asyncio.TimeoutError:
            saved = False
        if not saved:
            logger.warning("predictor: %d models' observations could not be saved to Redis before stop",
                           len(self.stats.pending))
