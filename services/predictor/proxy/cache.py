"""Semantic cache of true output lengths (µ-Serve §3.3 "Use of Semantic Cache").

Keys are L2-normalised sentence embeddings of prompts (so the inner product is
the cosine similarity), values the true output lengths observed for one target
model. A query hits when its nearest cached prompt *of the same model* has
cosine similarity >= ``threshold`` (µ-Serve/GPTCache default 0.8); the answer is
the mean of the lengths observed for that entry. An observation whose prompt is
within ``merge_threshold`` (0.98) of an existing entry is added to that entry
instead of creating a new one, so repeated prompts do not fill the cache.

Index: one exact inner-product index per model (faiss ``IndexFlatIP`` inside
``IndexIDMap2``). Exact search is linear in the entries of the model; measured
on this 2-core machine (`polyserve predictor bench` prints it too) it stays
around a millisecond up to ~10-20k entries, hence the default bound
``max_entries = 20000`` over all models. Eviction is least-recently-used (a hit
or an observation refreshes an entry); when full, the oldest 5% are evicted in
one batch so that the O(n) removal is amortised.

Persistence (Redis, see `RedisCacheStore`): keys live in a *key space* named
after the embedding that made them (``base`` for the published encoder, else a
hash of the artifact's LoRA adapter), so that entries made with other weights
are never compared with this encoder's embeddings. The hash
``<prefix>:predcache:<space>:m:<model>`` maps an entry id (hex) to a packed
record (sum of lengths float64, count uint32, dimension uint32, float16
vector), and the sorted set ``<prefix>:predcache:<space>:index`` holds
``<model>\\n<id>`` scored by the time the entry was last written; it bounds the
entries kept in Redis (oldest trimmed first) and lets other predictors pick up
new entries (`since`).
"""
from __future__ import annotations

import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from polyserve.proto import Keys

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.8
MERGE_THRESHOLD = 0.98
_HEADER = struct.Struct("<dII")  # sum, count, dim


@dataclass
class Entry:
    id: int
    model: str
    vector: np.ndarray  # float32, normalised
    total: float
    count: int

    @property
    def length(self) -> int:
        return max(0, int(round(self.total / max(1, self.count))))


@dataclass(frozen=True, slots=True)
class Hit:
    length: int
    similarity: float
    entry_id: int
    count: int


def pack(entry: Entry) -> bytes:
    vec = np.asarray(entry.vector, dtype=np.float16)
    return _HEADER.pack(float(entry.total), int(entry.count), vec.size) + vec.tobytes()


def unpack(entry_id: int, model: str, raw: bytes) -> Entry:
    total, count, dim = _HEADER.unpack_from(raw)
    vec = np.frombuffer(raw, dtype=np.float16, count=dim, offset=_HEADER.size).astype(np.float32)
    return Entry(entry_id, model, normalise(vec), total, count)


def normalise(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


class SemanticCache:
    """In-memory, bounded, LRU semantic cache with one faiss index per target model."""

    def __init__(self, dim: int, *, threshold: float = DEFAULT_THRESHOLD, max_entries: int = 20_000,
                 merge_threshold: float = MERGE_THRESHOLD, id_source: Callable[[], int] | None = None):
        import faiss

        # one query at a time: OpenMP threads only add waiting (20-50x slower on a busy 2-core machine)
        faiss.omp_set_num_threads(1)
        self._faiss = faiss
        self.dim = dim
        self.threshold = threshold
        self.merge_threshold = max(merge_threshold, threshold)
        self.max_entries = max_entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # LRU order: oldest first
        self.indexes: dict[str, object] = {}
        self._next_id = id_source or self._counter()
        self.hits = 0
        self.misses = 0
        self.evicted = 0

    @staticmethod
    def _counter() -> Callable[[], int]:
        # ids unique across predictor instances sharing Redis: time-based, 63 bits
        state = {"last": 0}

        def nxt() -> int:
            v = max(time.time_ns() & 0x7FFF_FFFF_FFFF_FFFF, state["last"] + 1)
            state["last"] = v
            return v

        return nxt

    def __len__(self) -> int:
        return len(self.entries)

    def _index(self, model: str):
        idx = self.indexes.get(model)
        if idx is None:
            idx = self._faiss.IndexIDMap2(self._faiss.IndexFlatIP(self.dim))
            self.indexes[model] = idx
        return idx

    def nearest(self, model: str, key: np.ndarray) -> tuple[Entry, float] | None:
        """The nearest entry of `model` and its cosine similarity (None when the model has none)."""
        idx = self.indexes.get(model)
        if idx is None or idx.ntotal == 0:
            return None
        sims, ids = idx.search(normalise(key)[None, :], 1)
        entry = self.entries.get(int(ids[0, 0]))
        return (entry, float(sims[0, 0])) if entry is not None else None

    def lookup(self, model: str, key: np.ndarray) -> Hit | None:
        """A hit when the nearest prompt of `model` is at least `threshold` similar."""
        found = self.nearest(model, key)
        if found is None or found[1] < self.threshold:
            self.misses += 1
            return None
        entry, sim = found
        self.entries.move_to_end(entry.id)
        self.hits += 1
        return Hit(entry.length, sim, entry.id, entry.count)

    def observe(self, model: str, key: np.ndarray, length: int) -> Entry:
        """Record a true length: merged into a near-identical entry, else a new entry."""
        key = normalise(key)
        found = self.nearest(model, key)
        if found is not None and found[1] >= self.merge_threshold:
            entry = found[0]
            entry.total += float(length)
            entry.count += 1
            self.entries.move_to_end(entry.id)
            return entry
        entry = Entry(self._next_id(), model, key, float(length), 1)
        self.put(entry)
        return entry

    def put(self, entry: Entry) -> None:
        """Insert or replace an entry (e.g. loaded from Redis), evicting if full."""
        if entry.id in self.entries:
            self._remove(entry.model, [entry.id])
        self._index(entry.model).add_with_ids(normalise(entry.vector)[None, :], np.array([entry.id], dtype=np.int64))
        self.entries[entry.id] = entry
        if len(self.entries) > self.max_entries:
            self._evict(max(1, len(self.entries) - int(self.max_entries * 0.95)))

    def _remove(self, model: str, ids: list[int]) -> None:
        idx = self.indexes.get(model)
        if idx is not None:
            idx.remove_ids(np.asarray(ids, dtype=np.int64))
        for i in ids:
            self.entries.pop(i, None)

    def _evict(self, n: int) -> list[Entry]:
        victims = [self.entries[i] for i in list(self.entries)[:n]]
        by_model: dict[str, list[int]] = {}
        for e in victims:
            by_model.setdefault(e.model, []).append(e.id)
        for model, ids in by_model.items():
            self._remove(model, ids)
        self.evicted += len(victims)
        return victims


class RedisCacheStore:
    """The cache's Redis copy: one hash per model plus an index sorted by write time."""

    def __init__(self, redis, prefix: str, space: str = "base", *, max_entries: int = 20_000):
        self.r = redis
        self.prefix = prefix
        self.space = space
        self.max_entries = max_entries

    def hash_key(self, model: str) -> str:
        return Keys(self.prefix).predcache(self.space, model)

    @property
    def index_key(self) -> str:
        return Keys(self.prefix).predcache_index(self.space)

    async def save(self, entry: Entry) -> None:
        """Write one entry and trim the oldest beyond `max_entries`."""
        async with self.r.pipeline(transaction=False) as p:
            p.hset(self.hash_key(entry.model), format(entry.id, "x"), pack(entry))
            p.zadd(self.index_key, {f"{entry.model}\n{entry.id:x}": time.time()})
            p.zcard(self.index_key)
            *_, size = await p.execute()
        if size > self.max_entries:
            await self.trim(size - self.max_entries)

    async def trim(self, n: int) -> int:
        popped = await self.r.zpopmin(self.index_key, n)
        async with self.r.pipeline(transaction=False) as p:
            for member, _ in popped:
                model, _, hid = (member.decode() if isinstance(member, bytes) else member).rpartition("\n")
                p.hdel(self.hash_key(model), hid)
            await p.execute()
        return len(popped)

    async def load(self, since: float = 0.0, limit: int | None = None) -> tuple[list[Entry], float]:
        """Entries written after `since` (newest last), and the latest write time seen."""
        limit = limit or self.max_entries
        members = await self.r.zrangebyscore(self.index_key, f"({since}", "+inf", withscores=True)
        members = members[-limit:]
        latest = since
        by_model: dict[str, list[str]] = {}
        for member, score in members:
            model, _, hid = (member.decode() if isinstance(member, bytes) else member).rpartition("\n")
            by_model.setdefault(model, []).append(hid)
            latest = max(latest, float(score))
        entries: list[Entry] = []
        for model, hids in by_model.items():
            raws = await self.r.hmget(self.hash_key(model), hids)
            for hid, raw in zip(hids, raws):
                if raw:
                    try:
                        entries.append(unpack(int(hid, 16), model, raw))
                    except (struct.error, ValueError):
                        logger.warning("semantic cache: unreadable entry %s of %s in Redis", hid, model)
        return entries, latest
