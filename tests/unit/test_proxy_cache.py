"""The semantic cache (faiss index, LRU bound, packing) and its request bookkeeping, without Redis."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("faiss")

from polyserve.predictor.proxy.cache import Entry, SemanticCache, normalise, pack, unpack  # noqa: E402
from polyserve.predictor.proxy.semantic import CacheService  # noqa: E402

pytestmark = pytest.mark.unit
DIM = 16


def vec(seed: int) -> np.ndarray:
    return normalise(np.random.default_rng(seed).standard_normal(DIM))


def near(v: np.ndarray, cos: float, seed: int = 99) -> np.ndarray:
    """A unit vector with cosine `cos` to `v`."""
    r = np.random.default_rng(seed).standard_normal(DIM)
    r = normalise(r - (r @ v) * v)
    return normalise(cos * v + np.sqrt(1 - cos ** 2) * r)


def test_hit_at_threshold_per_model_with_mean_length():
    c = SemanticCache(DIM, threshold=0.8)
    a = vec(1)
    c.observe("m", a, 100)
    assert c.lookup("m", a).length == 100
    assert c.lookup("m", near(a, 0.85)).length == 100  # a paraphrase
    assert c.lookup("m", near(a, 0.7)) is None  # too different
    assert c.lookup("other", a) is None  # another target model has its own entries
    c.observe("m", near(a, 0.99), 200)  # near-identical: merged into the entry
    assert len(c) == 1
    hit = c.lookup("m", a)
    assert (hit.length, hit.count) == (150, 2) and hit.similarity == pytest.approx(1.0, abs=1e-5)
    c.observe("m", near(a, 0.9), 50)  # similar but distinct prompt: its own entry
    assert len(c) == 2
    assert c.hits == 3 and c.misses == 2


def test_lru_eviction_keeps_the_bound():
    c = SemanticCache(DIM, threshold=0.99, max_entries=20)
    vs = [vec(i) for i in range(40)]
    for i in range(20):
        c.observe("m", vs[i], i)
    assert c.lookup("m", vs[0]).length == 0  # refreshes entry 0
    for i in range(20, 40):
        c.observe("m" if i % 2 else "n", vs[i], i)
    assert len(c) <= 20 and c.evicted >= 20
    assert sum(idx.ntotal for idx in c.indexes.values()) == len(c)
    assert c.lookup("m", vs[1]) is None  # old and never used: gone
    assert c.lookup("m", vs[39]).length == 39  # recent: kept


def test_pack_round_trip_is_float16_exact_enough():
    e = Entry(12345, "m", vec(3), 300.0, 2)
    raw = pack(e)
    assert len(raw) == 16 + 2 * DIM
    back = unpack(12345, "m", raw)
    assert (back.id, back.model, back.total, back.count, back.length) == (12345, "m", 300.0, 2, 150)
    assert float(back.vector @ e.vector) > 0.999


async def test_completed_events_fill_the_cache_only_for_predicted_natural_stops():
    t = [0.0]
    svc = CacheService(SemanticCache(DIM), None, pending_max=3, pending_ttl_s=10, clock=lambda: t[0])
    a, b = vec(1), vec(2)
    assert svc.lookup("r1", "m", a) is None
    assert await svc.on_completed("r1", "m", 42, "stop")
    assert svc.lookup("r2", "m", near(a, 0.9)).length == 42
    assert not await svc.on_completed("unknown", "m", 1, "stop")  # not predicted here
    svc.remember("r3", "m", b)
    assert not await svc.on_completed("r3", "m", 16, "length")  # cut by max_tokens: not natural
    svc.remember("r4", "m", b)
    t[0] = 11.0
    assert not await svc.on_completed("r4", "m", 16, "stop")  # expired
    for i in range(5):
        svc.remember(f"x{i}", "m", b)
    assert len(svc.pending) == 3 and list(svc.pending) == ["x2", "x3", "x4"]  # bounded, oldest dropped
    assert svc.stats()["learned"] == 1
