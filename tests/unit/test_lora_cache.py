"""The adapter cache policy (pure): tiers, budgets, eviction score, prefetch of rising adapters."""
from __future__ import annotations

import math

import pytest

from polyserve.worker.lora_cache import DEVICE, DISK, HOST, AdapterCache, CacheError, CachePolicy

pytestmark = pytest.mark.unit


def _cache(**kw) -> AdapterCache:
    return AdapterCache(CachePolicy(**kw))


def _promote(c: AdapterCache, name: str, now: float = 0.0) -> list[str]:
    """Disk -> host -> device the way the engine does it; returns the device victims demoted."""
    if c.tier(name) == DISK:
        for v in c.victims(name, HOST, now):
            c.demote(v)
        c.start(name, HOST)
        c.landed(name, HOST)
    vics = c.victims(name, DEVICE, now)
    assert vics is not None
    for v in vics:
        c.demote(v)
    c.start(name, DEVICE)
    c.landed(name, DEVICE)
    return vics


def test_score_is_a_decayed_request_count_and_rates_estimate_a_steady_stream():
    c = _cache(half_life_s=10.0, short_window_s=2.0, long_window_s=20.0)
    c.add("a", 100)
    c.observe("a", 0.0)
    c.observe("a", 10.0)
    assert c.score("a", 10.0) == pytest.approx(1.5)  # 1 * 2^-1 + 1
    assert c.score("a", 20.0) == pytest.approx(0.75)
    c2 = _cache(short_window_s=2.0, long_window_s=20.0)
    c2.add("s", 1)
    for i in range(2000):  # 5 requests/s for 400 s
        c2.observe("s", i * 0.2)
    short, long_ = c2.rates("s", 399.8)
    assert short == pytest.approx(5.0, rel=0.06) and long_ == pytest.approx(5.0, rel=0.03)
    assert not c2.rising("s", 399.8)


def test_promotion_goes_disk_host_device_and_device_eviction_demotes_the_coldest_to_host():
    c = _cache(device_slots=2, host_slots=3)
    for n in "abcd":
        c.add(n, 10)
        assert c.tier(n) == DISK
    assert _promote(c, "a") == [] and _promote(c, "b") == []
    assert c.on(DEVICE) == ["a", "b"] and c.on(HOST) == ["a", "b"]  # the host tier is inclusive
    for t in (1.0, 2.0, 3.0):
        c.observe("a", t)
    c.observe("b", 3.0)
    c.observe("c", 3.5)
    assert c.victims("c", DEVICE, 4.0) == ["b"]  # b: 1 recent request < a: 3 requests
    assert _promote(c, "c", 4.0) == ["b"]
    assert (c.tier("a"), c.tier("b"), c.tier("c")) == (DEVICE, HOST, DEVICE)
    # host tier full (a, b, c): d's host copy evicts the host-only b to disk, never a device adapter
    assert c.victims("d", HOST, 4.0) == ["b"]
    _promote(c, "d", 4.0)
    assert c.tier("b") == DISK and len(c.on(HOST)) == 3 and len(c.on(DEVICE)) == 2


def test_recency_breaks_ties_and_popularity_beats_recency_within_the_half_life():
    c = _cache(device_slots=2, half_life_s=100.0)
    for n in "abc":
        c.add(n, 1)
    _promote(c, "a")
    _promote(c, "b")
    c.observe("a", 1.0)
    c.observe("b", 2.0)
    assert c.victims("c", DEVICE, 3.0) == ["a"]  # same count, a older: lower decayed score
    for t in range(5):
        c.observe("a", 3.0 + t * 0.1)
    c.observe("b", 9.0)
    assert c.victims("c", DEVICE, 10.0) == ["b"]  # b is more recent, a far more popular


def test_pinned_and_loading_adapters_are_never_victims_and_byte_budgets_count():
    c = _cache(device_slots=2, device_bytes=150, host_slots=4)
    for n, size in (("a", 100), ("b", 40), ("c", 60), ("huge", 200)):
        c.add(n, size)
    _promote(c, "a")
    _promote(c, "b")
    c.pin("a")
    assert c.victims("c", DEVICE, 0.0) is None  # needs a's 100 bytes; a is pinned
    assert c.victims("huge", DEVICE, 0.0) is None  # bigger than the whole device budget
    c.unpin("a")
    assert c.victims("c", DEVICE, 0.0) == ["a"] or c.victims("c", DEVICE, 0.0) == ["b", "a"]
    c.demote("b")
    c.start("b", DEVICE)  # in flight: counts against the device budget, cannot be evicted
    assert c.loading("b") == DEVICE
    assert c.victims("c", DEVICE, 0.0) == ["a"]
    c.pin("a")
    with pytest.raises(CacheError, match="in use"):
        c.demote("a")
    with pytest.raises(CacheError):
        c.unpin("c")
    c.failed("b")
    assert c.loading("b") is None and c.tier("b") == HOST


def test_prefetch_picks_rising_adapters_not_on_device_with_colder_victims():
    c = _cache(device_slots=1, short_window_s=1.0, long_window_s=30.0, rise_factor=2.0, min_rate=2.0,
               half_life_s=30.0)
    for n in "abc":
        c.add(n, 1)
    _promote(c, "a")
    for t in range(60):  # a: steady 1 req/s, on the device
        c.observe("a", float(t))
    assert c.prefetch(60.0) == []
    for t in (59.0, 59.3, 59.6, 59.9):  # b: a burst
        c.observe("b", t)
    c.observe("c", 59.9)  # c: one request, below min_rate
    assert c.rising("b", 60.0) and not c.rising("c", 60.0) and not c.rising("a", 60.0)
    # a's decayed count (~30 s half-life over 60 requests) is far above b's 4: no victim colder than b
    assert c.prefetch(60.0) == []
    c2 = _cache(device_slots=2, short_window_s=1.0, long_window_s=30.0, min_rate=2.0)
    for n in "abc":
        c2.add(n, 1)
    _promote(c2, "a")
    for t in (9.0, 9.3, 9.6, 9.9):
        c2.observe("b", t)
        c2.observe("c", t + 0.05)
    c2.observe("c", 9.95)
    # one free slot, two rising adapters: the hotter (c) takes it, then b would need a colder victim (a: 0)
    assert c2.prefetch(10.0, limit=2) == [("c", []), ("b", ["a"])]
    assert c2.tier("c") == DISK and c2.loading("c") is None and c2.tier("a") == DEVICE  # it only proposes


def test_bad_policies_and_moves_are_clear_errors():
    with pytest.raises(CacheError, match="host_slots >= device_slots"):
        CachePolicy(device_slots=4, host_slots=2)
    with pytest.raises(CacheError, match="short_window_s"):
        CachePolicy(short_window_s=60, long_window_s=5)
    with pytest.raises(CacheError, match="rise_factor"):
        CachePolicy(rise_factor=1.0)
    c = _cache()
    c.add("a", 1)
    with pytest.raises(CacheError, match="already in the cache"):
        c.add("a", 1)
    with pytest.raises(CacheError, match="not in the cache"):
        c.observe("x", 0.0)
    with pytest.raises(CacheError, match="only on disk"):
        c.demote("a")
    c.start("a", HOST)
    with pytest.raises(CacheError, match="already being copied"):
        c.start("a", DEVICE)
    assert math.isclose(c.score("a", 5.0), 0.0)
