"""The semantic cache as the predictor service uses it: lookups, learning from `completed`, Redis.

`Completed` events carry no prompt text, so a predicted request's cache key (its
prompt embedding, computed anyway by the model pass) and target model are
remembered by request id, at most ``pending_max`` of them for at most
``pending_ttl_s``; when the request's `completed` event arrives, its true output
length is recorded under that key. Only requests that finished naturally
(``finish_reason == "stop"``) are recorded: a length cut by ``max_tokens`` is
not the prompt's natural length.

Every predictor instance listens to every `completed` event (no queue group)
and records only the requests it predicted itself; entries are written to
Redis (`cache.RedisCacheStore`) and other instances read them every ``sync_s``.
Redis failures are logged and never fail a prediction: the cache then lives in
memory only until Redis is back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from polyserve.predictor.proxy.cache import Hit, RedisCacheStore, SemanticCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pending:
    key: np.ndarray
    model: str
    at: float


class CacheService:
    def __init__(self, cache: SemanticCache, store: RedisCacheStore | None, *, pending_max: int = 10_000,
                 pending_ttl_s: float = 600.0, redis_timeout_s: float = 0.5, clock=time.monotonic):
        self.cache = cache
        self.store = store
        self.pending: OrderedDict[str, Pending] = OrderedDict()
        self.pending_max = pending_max
        self.pending_ttl_s = pending_ttl_s
        self.redis_timeout_s = redis_timeout_s
        self.clock = clock
        self.learned = 0
        self.skipped = 0
        self.redis_errors = 0
        self._synced_until = 0.0

    # ---------------------------------------------------------------- predict path
    def lookup(self, request_id: str, model: str, key: np.ndarray) -> Hit | None:
        """Remember the request for its `completed` event, and answer from the cache if it hits."""
        self.remember(request_id, model, key)
        return self.cache.lookup(model, key)

    def remember(self, request_id: str, model: str, key: np.ndarray) -> None:
        now = self.clock()
        while self.pending:  # expired first (oldest first), then the bound
            oldest = next(iter(self.pending.values()))
            if now - oldest.at <= self.pending_ttl_s and len(self.pending) < self.pending_max:
                break
            self.pending.popitem(last=False)
        self.pending[request_id] = Pending(key, model, now)
        self.pending.move_to_end(request_id)

    # ---------------------------------------------------------------- learning
    async def on_completed(self, request_id: str, model: str, output_tokens: int, finish_reason: str) -> bool:
        """Record a predicted request's true length; False when it is not one to record."""
        p = self.pending.pop(request_id, None)
        if p is None or self.clock() - p.at > self.pending_ttl_s:
            return False
        if finish_reason != "stop" or output_tokens < 0 or (model and model != p.model):
            self.skipped += 1
            return False
        entry = self.cache.observe(p.model, p.key, output_tokens)
        self.learned += 1
        if self.store is not None:
            try:
                await asyncio.wait_for(self.store.save(entry), self.redis_timeout_s)
            except Exception as exc:  # noqa: BLE001 - Redis trouble must not lose the in-memory entry
                self.redis_errors += 1
                logger.warning("semantic cache: cannot save entry of %s to Redis: %s", p.model, exc)
        return True

    # ---------------------------------------------------------------- Redis
    async def sync(self) -> int:
        """Read entries written (by any predictor) since the last sync."""
        if self.store is None:
            return 0
        entries, latest = await self.store.load(since=self._synced_until)
        n = 0
        for e in entries:
            mine = self.cache.entries.get(e.id)
            if mine is not None and mine.count >= e.count:
                continue
            self.cache.put(e)
            n += 1
        self._synced_until = latest
        return n

    def stats(self) -> dict:
        c = self.cache
        return {"entries": len(c), "hits": c.hits, "misses": c.misses, "evicted": c.evicted,
                "learned": self.learned, "pending": len(self.pending), "redis_errors": self.redis_errors}
