"""Aladdin worker sizing: TP degree by Eq. 6, N_w = ceil(k5·r + c5), CUSUM re-planning."""
import math
from pathlib import Path

import numpy as np
import pytest

from polyserve.planner import sizing
from polyserve.planner.sizing import Cusum, SizingState, TpCandidate

pytestmark = pytest.mark.unit
SPLITWISE = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "profiles" / \
    "splitwise_llama2_70b_bloom_176b_a100_h100.csv"
needs_splitwise = pytest.mark.skipif(not SPLITWISE.is_file(), reason=f"{SPLITWISE} not present")


def cand(tp, c3=30.0, per_seq=0.3, kv=100_000.0):
    return TpCandidate(tp=tp, k2=0.0, c2=per_seq, c3=c3, kv_tokens=kv)


def test_eq6_is_the_min_of_the_kv_and_slo_bounds():
    # KV-bound: 20,000 tokens / 1,000 per request = 20 sequences, t(20) = 30 + 0.3·20 = 36 ms
    s = sizing.score_tp(cand(2, kv=20_000.0), mean_kv_tokens=1000, l_avg=500, atgt_slo_ms=60.0)
    assert s.feasible and s.bound == "kv" and s.batch_kv == pytest.approx(20)
    assert s.tokens_per_s_per_gpu == pytest.approx(1000 * 20 / (2 * 36.0))
    # SLO-bound: B_slo = (60 − 30)/0.3 = 100 sequences per 60 ms
    s = sizing.score_tp(cand(4, kv=1e7), mean_kv_tokens=1000, l_avg=500, atgt_slo_ms=60.0)
    assert s.bound == "slo" and s.batch_slo == pytest.approx(100)
    assert s.tokens_per_s_per_gpu == pytest.approx(1000 * 100 / (4 * 60.0))
    # Eq. 6 equals b_eff / (N_g · t(b_eff)) either way (b/t(b) rises with b)
    for c in (cand(2, kv=20_000.0), cand(4, kv=1e7)):
        s = sizing.score_tp(c, 1000, 500, 60.0)
        b = min(s.batch_kv, s.batch_slo)
        assert s.tokens_per_s_per_gpu == pytest.approx(1000 * b / (c.tp * c.iteration_ms(b, 500)))


def test_infeasible_degrees_and_the_best_one():
    no_room = sizing.score_tp(cand(1, kv=500.0), 1000, 500, 60.0)
    too_slow = sizing.score_tp(cand(2, c3=70.0), 1000, 500, 60.0)
    assert not no_room.feasible and "KV" in no_room.bound
    assert not too_slow.feasible and "SLO" in too_slow.bound
    best, scores = sizing.best_tp([cand(1, kv=500.0), cand(2, kv=20_000.0), cand(4, kv=1e7)], 1000, 500, 60.0)
    assert [s.tp for s in scores] == [1, 2, 4] and best.tp == 4
    assert sizing.best_tp([cand(1, kv=1.0)], 1000, 500, 60.0)[0] is None


@needs_splitwise
def test_llama2_70b_on_h100_from_the_splitwise_profile():
    cands = sizing.splitwise_candidates(SPLITWISE, "llama2-70b", "h100-80gb")
    assert [c.tp for c in cands] == [2, 4, 8]  # TP 1 is not in the profile (weights do not fit)
    assert all(c.k2 >= 0 and c.c3 > 0 and c.kv_tokens > 0 for c in cands)
    best, scores = sizing.best_tp(cands, mean_kv_tokens=1100, l_avg=1000, atgt_slo_ms=50.0)
    assert best.tp == 4  # TP 2 is KV-starved (46 sequences), TP 8 spends 8 GPUs for a similar batch
    by_tp = {s.tp: s for s in scores}
    assert by_tp[2].batch_kv < by_tp[4].batch_kv < by_tp[8].batch_kv
    ext = sizing.extrapolate_candidate(cands, 16, 1e6)
    assert "extrapolated" in ext.source and ext.c3 > 0


def test_tp_scaling_recovers_eq5_coefficients():
    k4, c4, kc = 40.0, 10.0, 6.0  # compute k4/N + c4, all-reduce kc·(N−1)/N: one curve a/N + b
    pts = [(n, k4 / n + c4 + kc * (n - 1) / n) for n in (1, 2, 4, 8)]
    assert sizing.tp_scaling(pts) == pytest.approx((k4 - kc, c4 + kc))
    with pytest.raises(ValueError):
        sizing.tp_scaling(pts[:1])


def test_worker_count_least_squares_and_ceiling():
    hist = [(r, 0.5 * r + 2) for r in (10, 20, 30, 40)] + [(1.0, 9.0)]  # the last is below R
    m = sizing.fit_worker_count(hist, min_rate=5.0)
    assert (m.k5, m.c5, m.samples) == (pytest.approx(0.5), pytest.approx(2.0), 4)
    assert m.workers(25.0) == math.ceil(0.5 * 25 + 2) == 15
    assert m.workers(20.0) == 12  # exact integers are not rounded up by float noise
    assert m.workers(1.0) == m.workers(5.0) == 5  # at r <= R the count at R
    with pytest.raises(ValueError):
        sizing.fit_worker_count([(1.0, 3.0)], min_rate=5.0)
    assert sizing.fit_worker_count([(10.0, 4.0), (10.0, 6.0)]).workers(20.0) == 10
    assert sizing.workers_for_rate(10.0, 200, tokens_per_s_per_gpu=100, tp=4) == 5


def test_cusum_is_quiet_in_control_and_fires_on_a_shift():
    rng = np.random.default_rng(7)
    st, alarms = Cusum(), 0
    for x in rng.normal(50, 5, 200):
        st, fired = sizing.cusum_update(st, x)
        alarms += fired
    assert alarms == 0 and st.ready and st.mean == pytest.approx(50, abs=5)
    for i, x in enumerate(rng.normal(65, 5, 50)):  # a 3σ step up
        st, fired = sizing.cusum_update(st, x)
        if fired:
            break
    assert fired and i < 10 and st.alarms == 1 and not st.ready  # warm-up restarts on the new regime
    flat = Cusum(warmup=3)
    for _ in range(3):
        flat, _ = sizing.cusum_update(flat, 0.0)
    assert flat.sigma > 0  # a flat warm-up does not make every later sample an alarm


def test_sizing_step_refits_after_a_change_point():
    st = SizingState(detector=Cusum(warmup=5))
    for _ in range(10):  # steady 10 req/s needing 3 workers
        st, d = sizing.sizing_step(st, 10.0 + np.random.default_rng(1).normal(0, 0.1), 3)
    assert d.workers == 3 and not d.replan
    st, d = sizing.sizing_step(st, 40.0, 9)  # load quadruples
    assert d.replan and "change point" in d.reason
    assert len(st.history) == 1 and d.workers >= 9
    _, d = sizing.sizing_step(SizingState(), 5.0)
    assert d.workers is None and "no (rate, workers) history" in d.reason
