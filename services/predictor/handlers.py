"""Predictor handlers: answer PredictRequests and learn from Completed events.

Model names are normalised once (`polyserve.core.model_names.canonical`) for the length
history and the semantic cache, so `gpt-3.5-turbo`, `GPT-3.5-Turbo` and `gpt-35-turbo`
share one history; the proxy model resolves names itself (`artifact.Meta.resolve`).
Every source answers in the same length-class scheme (`class_bounds`): the artifact's
per-model percentile classes for a model the artifact knows, else its unseen-model classes
(`polyserve.core.length_classes`); without an artifact, `settings.bounds`.

`LengthStats` keeps an in-memory copy of the Redis length statistics so that a
prediction never waits on Redis longer than `redis_timeout_s`, and a brief Redis
outage is answered from memory. Observations that cannot be written are kept
(aggregated per model and bucket, so the buffer is bounded) and written later.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis

from polyserve.core.model_names import canonical
from polyserve.predictor import policy
from polyserve.predictor.config import PredictorSettings
from polyserve.proto import Completed, Keys, PredictBatch, Prediction, Predictions, PredictRequest
from polyserve.shared.bus import BusError

logger = logging.getLogger(__name__)
T = TypeVar("T")
SOURCE_MODEL = "model"
FLUSH_EVERY_S = 0.25
SOURCE_CACHE = "cache"


class RedisUnavailable(Exception):
    """Redis did not answer in time, failed, or is in its retry back-off."""


class LengthStats:
    """Per-model length statistics: a Redis hash shared by all predictors, and a local copy.

    The view of a model is ``snapshot`` (last read from Redis, plus what this
    instance wrote since) merged with ``flushing`` (being written now) and
    ``pending`` (observations not yet written).
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, timeout_s: float, retry_s: float,
                 max_models: int, clock: Callable[[], float] = time.monotonic):
        self.r = redis
        self.keys = keys
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_models = max_models
        self.clock = clock
        self.snapshot: OrderedDict[str, policy.ModelStats] = OrderedDict()
        self.pending: dict[str, policy.ModelStats] = {}
        self.flushing: dict[str, policy.ModelStats] = {}
        self._lock = asyncio.Lock()
        self._down_until = 0.0
        self.redis_ok = True
        self.redis_errors = 0
        self.dropped = 0

    # ------------------------------------------------------------ redis access
    async def _redis(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run one Redis operation within the timeout; RedisUnavailable on failure or back-off."""
        if self.clock() < self._down_until:
            raise RedisUnavailable(f"{what}: Redis in back-off")
        try:
            result = await asyncio.wait_for(op(), self.timeout_s)
        except Exception as exc:  # timeout, connection refused, ... : answer from memory
            self.redis_errors += 1
            self._down_until = self.clock() + self.retry_s
            if self.redis_ok:
                logger.warning("predictor: Redis unavailable (%s: %s: %s); answering from memory",
                               what, type(exc).__name__, exc)
            self.redis_ok = False
            raise RedisUnavailable(f"{what}: {exc}") from exc
        if not self.redis_ok:
            logger.info("predictor: Redis reachable again")
        self.redis_ok = True
        return result

    def _remember(self, model: str, stats: policy.ModelStats) -> None:
        self.snapshot[model] = stats
        self.snapshot.move_to_end(model)
        while len(self.snapshot) > self.max_models:
            self.snapshot.popitem(last=False)

    # ------------------------------------------------------------ reads
    async def get(self, model: str) -> policy.ModelStats:
        """The statistics of `model`; loads them from Redis on first use, else answers from memory."""
        base = self.snapshot.get(model)
        if base is not None:
            self.snapshot.move_to_end(model)
        else:
            try:
                raw = await self._redis(lambda: self.r.hgetall(self.keys.lenstats(model)), "load stats")
            except RedisUnavailable:
                base = policy.ModelStats()
            else:
                base = policy.parse_hash(raw)
                if model not in self.snapshot:  # a concurrent get() may have loaded it meanwhile
                    self._remember(model, base)
                base = self.snapshot.get(model, base)
        for extra in (self.flushing.get(model), self.pending.get(model)):
            if extra is not None:
                base = base.merged(extra)
        return base

    async def refresh(self) -> None:
        """Re-read every model kept in memory (picks up what other predictors learned)."""
        async with self._lock:
            models = list(self.snapshot)
            if not models:
                return

            async def read() -> list[Any]:
                async with self.r.pipeline(transaction=False) as p:
                    for m in models:
                        p.hgetall(self.keys.lenstats(m))
                    return await p.execute()

            try:
                raws = await self._redis(read, "refresh stats")
            except RedisUnavailable:
                return
            for m, raw in zip(models, raws):
                if m in self.snapshot:
                    self.snapshot[m] = policy.parse_hash(raw)

    # ------------------------------------------------------------ writes
    def add(self, model: str, input_tokens: int, output_tokens: int) -> bool:
        """Buffer one observation; False (and counted) when the buffer has no room for a new model."""
        if model not in self.pending and len(self.pending) >= self.max_models:
            self.dropped += 1
            return False
        self.pending[model] = policy.observe(self.pending.get(model, policy.ModelStats()),
                                             input_tokens, output_tokens)
        return True

    async def flush(self) -> bool:
        """Write buffered observations with HINCRBY/HINCRBYFLOAT; True when nothing is left.

        A write that times out may still have been applied by Redis, and the
        retry then counts that batch twice; that skews the means only slightly,
        but keep `redis_timeout_s` well above Redis's normal latency.
        """
        async with self._lock:
            if not self.pending:
                return True
            batch, self.pending = self.pending, {}
            self.flushing = batch

            async def write() -> None:
                async with self.r.pipeline(transaction=True) as p:
                    for model, stats in batch.items():
                        key = self.keys.lenstats(model)
                        for fld, inc in policy.stats_increments(stats):
                            if isinstance(inc, float):
                                p.hincrbyfloat(key, fld, inc)
                            else:
                                p.hincrby(key, fld, inc)
                    await p.execute()

            try:
                await self._redis(write, "save stats")
            except BaseException as exc:  # also on cancellation: keep them for the next try
                for model, stats in batch.items():
                    self.pending[model] = stats.merged(self.pending.get(model, policy.ModelStats()))
                if isinstance(exc, RedisUnavailable):
                    return False
                raise
            finally:
                self.flushing = {}
            for model, stats in batch.items():
                if model in self.snapshot:
                    self.snapshot[model] = self.snapshot[model].merged(stats)
            return not self.pending


def history_key(model: str) -> str:
    """The model's key in the length history and the semantic cache: its canonical name.
    (Redis hashes written before issue 17 under the raw name are not read: that history
    restarts once, from the prior, and needs `min_samples` completions per bucket again.)"""
    return canonical(model) or model


def artifact_meta(settings: PredictorSettings) -> Any:
    """The configured artifact's meta.json (JSON only, no torch), or None: its class
    scheme is used by every source, the history and the prior included."""
    if not settings.artifact_dir:
        return None
    try:
        from polyserve.predictor.proxy import artifact

        return artifact.read_meta(settings.artifact_dir)
    except Exception as exc:  # noqa: BLE001 - no artifact: the history answers with settings.bounds
        logger.warning("predictor: no class scheme from artifact %s (%s); using class_bounds %s",
                       settings.artifact_dir, exc, settings.bounds)
        return None


class PredictHandlers:
    """`polyserve.v1.predict` and the `completed` event listener."""

    def __init__(self, settings: PredictorSettings, stats: LengthStats, runner: Any = None,
                 meta: Any = None):
        self.settings = settings
        self.stats = stats
        self._flushed_at = 0.0  # monotonic time of the last write from on_completed
        self.bounds = settings.bounds
        self._meta = meta if meta is not None else artifact_meta(settings)
        self.runner = runner  # proxy.runtime.ModelRunner, or None without a model
        self.cache: Any = None  # proxy.semantic.CacheService once the model's encoder is loaded
        self.answers: dict[str, int] = {}  # by source
        self.fallbacks: dict[str, int] = {}  # why the model did not answer
        self.learned = 0
        self.ignored = 0

    @property
    def meta(self) -> Any:
        """The loaded model's meta, else the configured artifact's, else None."""
        loaded = getattr(self.runner, "meta", None) if self.runner is not None else None
        return loaded if loaded is not None else self._meta

    def class_bounds(self, model: str) -> tuple[float, ...]:
        """Length-class bounds of `model`: the artifact's classes for it (its own when known,
        the unseen-model classes otherwise), else `settings.bounds` (no artifact)."""
        meta = self.meta
        return tuple(meta.classes_for(model).bounds) if meta is not None else self.bounds

    async def _from_model(self, req: PredictRequest) -> Prediction | None:
        """The semantic cache's or the proxy model's answer, capped at `req.max_tokens`
        (its length class then follows the capped value); None to fall back to the history."""
        if self.runner is None or not req.prompt:
            return None
        from polyserve.predictor.proxy.runtime import Unavailable

        try:
            r = await self.runner.predict(req.prompt, req.model, self.settings.proxy_timeout_s)
        except Unavailable as exc:
            self.fallbacks[exc.reason] = self.fallbacks.get(exc.reason, 0) + 1
            logger.debug("predict %s: model unavailable (%s); using the history", req.request_id, exc)
            return None
        classes = self.runner.meta.classes_for(req.model)
        source, tokens, length_class = SOURCE_MODEL, r.tokens, r.length_class
        if self.cache is not None and r.key is not None:
            try:
                hit = self.cache.lookup(req.request_id, history_key(req.model), r.key)
            except Exception:  # a cache fault must not fail the prediction
                logger.exception("predict %s: semantic cache lookup failed", req.request_id)
                hit = None
            if hit is not None:
                source, tokens = SOURCE_CACHE, max(1, hit.length)
                length_class = int(classes.classes([hit.length])[0])
        cap = policy.capped(tokens, req.max_tokens)  # never above the request's hard cap
        if cap != tokens:
            tokens, length_class = cap, int(classes.classes([cap])[0])
        logger.debug("predict %s model=%s -> %d tokens (class %d, %s, batch %d, %.1f ms)", req.request_id,
                     req.model, tokens, length_class, source, r.batch_size, r.infer_ms)
        return Prediction(request_id=req.request_id, model=req.model, length_class=length_class,
                          tokens_estimate=tokens, source=source, num_classes=classes.num_classes)

    async def predict(self, req: PredictRequest) -> Prediction:
        """Estimate the output length of `req`, never above `req.max_tokens` when that is
        set (> 0; the gateway validated it); BusError 400 on invalid input."""
        if not req.model:
            raise BusError(400, "model must be a non-empty model name")
        if req.input_tokens < 0:
            raise BusError(400, f"input_tokens must be >= 0, got {req.input_tokens}")
        answer = await self._from_model(req)
        if answer is not None:
            self.answers[answer.source] = self.answers.get(answer.source, 0) + 1
            return answer
        stats = await self.stats.get(history_key(req.model))
        est = policy.estimate(stats, req.input_tokens, min_samples=self.settings.min_samples,
                              prior_tokens=self.settings.prior_tokens, bounds=self.class_bounds(req.model),
                              max_tokens=req.max_tokens)
        self.answers[est.source] = self.answers.get(est.source, 0) + 1
        logger.debug("predict %s model=%s in=%d -> %d tokens (class %d, %s, bucket %d, n=%d)",
                     req.request_id, req.model, req.input_tokens, est.tokens, est.length_class,
                     est.source, est.bucket, est.samples)
        return Prediction(request_id=req.request_id, model=req.model, length_class=est.length_class,
                          tokens_estimate=est.tokens, source=est.source, num_classes=est.num_classes)

    async def predict_batch(self, batch: PredictBatch) -> Predictions:
        """Answer every item of `batch` (concurrently: the proxy model batches them); an item
        refused as invalid is left out, and the gateway answers it locally."""
        answers = await asyncio.gather(*(self.predict(r) for r in batch.items), return_exceptions=True)
        for req, a in zip(batch.items, answers):
            if isinstance(a, BaseException) and not isinstance(a, BusError):
                raise a
            if isinstance(a, BusError):
                logger.warning("predict %s (batched): %s", req.request_id, a.description)
        return Predictions(items=[a for a in answers if isinstance(a, Prediction)])

    async def on_completed(self, ev: Completed) -> None:
        """Learn the true output length of a finished request."""
        if not ev.model or ev.input_tokens < 0 or ev.output_tokens < 0:
            self.ignored += 1
            logger.warning("ignoring completed event %s with model=%r input_tokens=%d output_tokens=%d",
                           ev.request_id, ev.model, ev.input_tokens, ev.output_tokens)
            return
        if not self.stats.add(history_key(ev.model), ev.input_tokens, ev.output_tokens):
            logger.warning("length-stats buffer full (%d models); dropped observation of %s",
                           len(self.stats.pending), ev.request_id)
            return
        self.learned += 1
        # One Redis write per FLUSH_EVERY_S at most, not one per request (a round trip, and
        # CPU in the predictor and Redis, for each completed request; issue 15). What is still
        # buffered goes with the next event, the refresh loop (`refresh_s`) or the drain.
        now = time.monotonic()
        if now - self._flushed_at >= FLUSH_EVERY_S:
            self._flushed_at = now
            await self.stats.flush()

    async def on_completed_cache(self, ev: Completed) -> None:
        """Record the true length of a request this instance predicted in the semantic cache."""
        if self.cache is not None:
            await self.cache.on_completed(ev.request_id, history_key(ev.model), ev.output_tokens,
                                          ev.finish_reason)
