import pytest

from polyserve.predictor import policy as p
from polyserve.predictor.config import PredictorSettings
from polyserve.shared.settings import SettingsError, load

pytestmark = pytest.mark.unit


def test_buckets_are_powers_of_two():
    assert [p.bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 1023, 1024)] == [0, 0, 1, 1, 2, 2, 3, 9, 10]
    for b in range(12):
        lo, hi = p.bucket_range(b)
        assert p.bucket_of(lo) == b and p.bucket_of(hi - 1) == b and p.bucket_of(hi) == b + 1


def test_length_classes_follow_bounds():
    assert p.DEFAULT_CLASS_BOUNDS == (101, 205, 290, 661)  # the unseen-model bounds (issue 17)
    bounds = (32, 128, 256, 512)
    assert [p.length_class(t, bounds) for t in (1, 31, 32, 127, 128, 255, 256, 511, 512, 10_000)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert p.parse_bounds("32, 128,256,512") == (32, 128, 256, 512)
    for bad in ("", "a,b", "128,32", "0,5", "5,5"):
        with pytest.raises(ValueError):
            p.parse_bounds(bad)


def test_prior_before_data_then_model_mean_then_bucket_mean():
    est = p.estimate(None, 100)
    assert (est.tokens, est.source, est.samples, est.length_class, est.num_classes) == (129, "prior", 0, 1, 5)
    stats = p.ModelStats()
    for _ in range(4):  # bucket 3 (8..15 tokens), below min_samples=5
        stats = p.observe(stats, 10, 40)
    assert p.estimate(stats, 10).source == "prior"
    stats = p.observe(stats, 1000, 540)  # 5 samples model-wide: mean (4*40 + 540) / 5 = 140
    est = p.estimate(stats, 10)
    assert (est.tokens, est.source, est.samples) == (140, "history", 5)
    stats = p.observe(stats, 12, 40)  # bucket 3 now has 5 samples of 40
    est = p.estimate(stats, 9)
    assert (est.tokens, est.source, est.samples, est.length_class) == (40, "history", 5, 0)
    # a bucket with too few samples falls back to the model-wide mean
    assert p.estimate(stats, 1000).tokens == round((5 * 40 + 540) / 6)
    assert p.estimate(stats, 10, min_samples=50, prior_tokens=7).tokens == 7


def test_estimate_never_exceeds_max_tokens():
    assert [p.capped(129, m) for m in (0, -1, 20, 129, 500)] == [129, 129, 20, 129, 129]
    est = p.estimate(None, 100, max_tokens=20)  # the prior (129, class 1) capped: class of 20
    assert (est.tokens, est.source, est.length_class) == (20, "prior", 0)
    assert p.estimate(None, 100, max_tokens=0).tokens == 129  # 0: no cap known
    stats = p.ModelStats()
    for _ in range(5):
        stats = p.observe(stats, 100, 300)
    est = p.estimate(stats, 100, max_tokens=100)
    assert (est.tokens, est.source, est.length_class, est.samples) == (100, "history", 0, 5)
    assert p.estimate(stats, 100, max_tokens=4096).tokens == 300


def test_redis_hash_round_trip_and_std():
    stats = p.ModelStats()
    fields: dict[str, float] = {}
    for inp, out in [(5, 10), (6, 20), (100, 300)]:
        stats = p.observe(stats, inp, out)
        for f, inc in p.hash_increments(inp, out):
            fields[f] = fields.get(f, 0) + inc
    raw = {f.encode(): str(v).encode() for f, v in fields.items()} | {b"junk": b"1", b"n:x": b"2"}
    parsed = p.parse_hash(raw)
    assert parsed == stats
    assert dict(p.stats_increments(stats)) == fields
    assert parsed.bucket(2).count == 2 and parsed.bucket(2).mean == 15 and parsed.bucket(2).std == 5
    assert parsed.overall.count == 3 and parsed.overall.total == 330


def test_settings_validate_bounds_and_defaults():
    s = load(PredictorSettings, "predictor", environ={})
    assert (s.min_samples, s.prior_tokens, s.bounds) == (5, 129, (101, 205, 290, 661))
    s = load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_CLASS_BOUNDS": "10,20"})
    assert s.bounds == (10, 20)
    with pytest.raises(SettingsError, match="class_bounds"):
        load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_CLASS_BOUNDS": "20,10"})
    with pytest.raises(SettingsError, match="min_samples"):
        load(PredictorSettings, "predictor", argv=["--min-samples", "0"], environ={})
