"""Arlo's request scheduler (Alg. 1) and the ILB / IG baselines as pure dispatch policies."""
import random
from dataclasses import replace

import pytest

from polyserve.dispatcher.policy import PolicyState, RequestView, WorkerView
from polyserve.dispatcher.policy_arlo import (
    ARLO_POLICIES,
    arlo_ig,
    arlo_ilb,
    arlo_mlq,
    capacity,
    congestion,
    levels,
    make_arlo_mlq,
)

pytestmark = pytest.mark.unit
RNG = random.Random(0)
S = PolicyState()


def w(wid: str, max_len: int, outstanding: int, cap: int) -> WorkerView:
    """A runtime instance as encoder workers report it: M_i as a token budget M × max_length."""
    return WorkerView(worker_id=wid, max_input_len=max_len, outstanding=outstanding,
                      kv_capacity=cap * max_len if max_len else 0, max_batch=cap if not max_len else 0)


def req(n: int) -> RequestView:
    return RequestView(request_id="r", input_tokens=n)


def test_capacity_and_congestion_read_the_token_budget():
    x = w("a", 128, 40, 80)
    assert capacity(x) == 80 and congestion(x) == 0.5
    assert capacity(WorkerView(worker_id="d", max_batch=12)) == 12  # dynamic runtime: no length
    assert capacity(WorkerView(worker_id="u")) >= 1  # nothing known: a default, never zero


def test_paper_figure5_example_demotes_one_level():
    """§3.4: L=3, λ=0.85, α=0.9, request of length 200: Q2's head is at 54/60 (>= 0.85), so the
    threshold decays to 0.765 and Q3's head at 28/48 takes it."""
    ws = [w("q1a", 128, 10, 80), w("q2a", 256, 54, 60), w("q2b", 256, 58, 60),
          w("q3a", 384, 28, 48), w("q3b", 384, 40, 48), w("q4a", 512, 2, 20)]
    assert make_arlo_mlq(0.85, 0.9, 3)(ws, req(200), S, RNG).worker_id == "q3a"


def test_ideal_runtime_when_it_is_not_congested():
    ws = [w("s", 64, 3, 80), w("m", 256, 0, 40), w("l", 512, 0, 20)]
    assert arlo_mlq(ws, req(30), S, RNG).worker_id == "s"
    assert arlo_mlq(ws, req(65), S, RNG).worker_id == "m"  # 64 cannot take 65 tokens


def test_threshold_decays_per_level():
    # ideal at P=0.9 (>= 0.85); next at P=0.8: below 0.85 but not below 0.765 -> third level
    ws = [w("a", 64, 9, 10), w("b", 128, 8, 10), w("c", 256, 6, 10)]
    assert arlo_mlq(ws, req(10), S, RNG).worker_id == "c"
    # the third level at 0.7 is not below 0.85*0.9*0.9 = 0.6885 either -> back to the ideal level
    ws[2] = w("c", 256, 7, 10)
    assert arlo_mlq(ws, req(10), S, RNG).worker_id == "a"


def test_at_most_L_levels_are_peeked():
    ws = [w("a", 64, 10, 10), w("b", 128, 10, 10), w("c", 256, 0, 10)]
    assert make_arlo_mlq(max_levels=3)(ws, req(10), S, RNG).worker_id == "c"
    assert make_arlo_mlq(max_levels=2)(ws, req(10), S, RNG).worker_id == "a"


def test_head_is_the_least_congested_instance_of_a_level():
    ws = [w("a1", 64, 7, 10), w("a2", 64, 2, 10), w("a3", 64, 5, 10)]
    assert arlo_mlq(ws, req(10), S, RNG).worker_id == "a2"


def test_longer_than_every_runtime_goes_to_the_longest_and_dynamic_is_the_top_level():
    ws = [w("a", 64, 0, 10), w("b", 128, 0, 10)]
    assert [n for n, _ in levels(ws, 500)] == [128]
    assert arlo_mlq(ws, req(500), S, RNG).worker_id == "b"
    dyn = WorkerView(worker_id="dyn", max_input_len=0, outstanding=0, max_batch=10)
    assert [n for n, _ in levels([*ws, dyn], 100)][-1] == float("inf")
    assert arlo_mlq([*ws, dyn], req(500), S, RNG).worker_id == "dyn"


def test_ilb_stays_on_the_ideal_runtime_even_when_congested():
    ws = [w("a1", 64, 90, 10), w("a2", 64, 50, 10), w("b", 512, 0, 10)]
    assert arlo_ilb(ws, req(10), S, RNG).worker_id == "a2"


def test_ig_takes_the_least_busy_candidate_anywhere():
    ws = [w("a", 64, 5, 10), w("b", 128, 1, 10), w("c", 512, 1, 20)]
    assert arlo_ig(ws, req(10), S, RNG).worker_id == "c"  # 1/20 < 1/10
    assert arlo_ig(ws, req(100), S, RNG).worker_id == "c"


def _replay(policy, workers, lengths):
    """Place requests one after another (none finishes), as in Fig. 4; count SLO violations."""
    ws = {x.worker_id: x for x in workers}
    placed, violations = [], 0
    for n in lengths:
        wid = policy(list(ws.values()), req(n), S, RNG).worker_id
        x = ws[wid]
        ws[wid] = replace(x, outstanding=x.outstanding + 1)
        violations += ws[wid].outstanding > capacity(x)
        placed.append(wid)
    return placed, violations


def test_figure4_scenario_shows_each_policy_s_trade_off():
    """§3.2 Fig. 4: 8 short requests (< 128), then 14 long ones (257-512), on 2×128, 1×256, 1×512."""
    gpus = [w("gpu0", 128, 78, 80), w("gpu1", 128, 79, 80), w("gpu2", 256, 28, 40), w("gpu3", 512, 6, 20)]
    lengths = [100] * 8 + [400] * 14
    ilb, v_ilb = _replay(arlo_ilb, gpus, lengths)
    ig, v_ig = _replay(arlo_ig, gpus, lengths)
    mlq, v_mlq = _replay(arlo_mlq, gpus, lengths)
    assert set(ilb[:8]) == {"gpu0", "gpu1"} and v_ilb == 5  # only 3 more fit on the 128 runtime
    assert ig[:8] == ["gpu3"] * 8 and v_ig == 8  # the greedy fills the 512 runtime the long ones need
    assert mlq[:3] == ["gpu2"] * 3 and mlq[3:8] == ["gpu3"] * 5  # demoted, then demoted again at P >= 0.765
    assert v_mlq < v_ig


def test_registry_names_and_bad_parameters():
    assert set(ARLO_POLICIES) == {"arlo_mlq", "arlo_ilb", "arlo_ig"}
    with pytest.raises(ValueError):
        make_arlo_mlq(alpha=0)
    with pytest.raises(ValueError):
        arlo_mlq([], req(1), S, RNG)


# ---------------------------------------------------------------- experiment helpers (same policies)
def _toy_profile():
    from polyserve.proto import EncoderProfile, RuntimeProfile

    lengths = [1, 128, 256, 384, 512]
    static = [[1.0 + 0.1 * n for n in lengths]]
    rts = [RuntimeProfile(name=f"r{n}", max_length=n, batch_size=1, latency_ms=[1.0 + 0.1 * n],
                          capacity=max(1, int(100 // (1.0 + 0.1 * n)))) for n in lengths[1:]]
    return EncoderProfile(model="toy", device="cpu", backend="jit", slo_ms=100.0, threads=1, lengths=lengths,
                          batches=[1], static_ms=static, dynamic_ms=[[1.2 * v for v in static[0]]], runtimes=rts,
                          dynamic=RuntimeProfile(name="d", max_length=0, batch_size=1, latency_ms=[62.4],
                                                 capacity=1, shape="dynamic"))


def test_workload_allocation_and_simulator():
    from polyserve.simulator import encoder as bsim

    rng = random.Random(1)
    xs = sorted(bsim.twitter_like(rng) for _ in range(20000))
    # Arlo §2.1: median 21, P98 72 tokens, stretched by 512/125
    assert 80 <= xs[len(xs) // 2] <= 92 and 280 <= xs[int(0.98 * len(xs))] <= 310 and xs[-1] <= 512
    prof = _toy_profile()
    alloc = bsim.allocate(8, prof, xs, rate=300.0)
    assert sum(alloc.values()) == 8 and alloc.get(512, 0) >= 1 and len(alloc) > 1
    # the planner's §3.3 ILP: the optimum of its objective (checked by enumeration)
    from polyserve.planner import arlo_ilp

    ps = [arlo_ilp.from_runtime_spec(r) for r in prof.runtimes]
    demand = arlo_ilp.demand_per_slo(xs, len(xs) / 300.0, prof.slo_ms / 1e3, [p.max_len for p in ps])
    best, _ = arlo_ilp.brute_force(8, demand, ps)
    assert arlo_ilp.evaluate([alloc.get(p.max_len, 0) for p in ps], demand, ps)[0] == pytest.approx(best)
    trace = bsim.arrivals(300.0, 20.0, random.Random(2), lengths=xs)
    assert 5000 < len(trace) < 7000 and all(a.t < 20.0 for a in trace)
    fl = bsim.fleets(prof, 8, xs, 300.0)
    st = bsim.summary(bsim.simulate(prof, fl["ST"], "least_outstanding", trace))
    poly = bsim.summary(bsim.simulate(prof, fl["polymorphing"], "arlo_mlq", trace))
    assert st["n"] == poly["n"] == len(trace)
    assert poly["mean"] < st["mean"]  # less padding, same instances
    bursty = bsim.arrivals(300.0, 20.0, random.Random(3), bursty=True, lengths=xs)
    assert abs(len(bursty) / 20.0 - 300.0) < 60.0
