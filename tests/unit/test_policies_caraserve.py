"""CaraServe rank-aware placement (§5): BGMV / MBGMV cost, SLO penalty, candidates;
and the MostIdle / FirstFit baselines."""
from __future__ import annotations

import random

import pytest

from polyserve.core.perf import BGMV, LORA_DEFAULTS, MBGMV, PerfModel, WorkerPerf
from polyserve.dispatcher import policy as p
from polyserve.dispatcher import policy_caraserve as c

pytestmark = pytest.mark.unit

# CaraServe §2.3 / Fig. 5: a base decode step of ≈31.8 ms, independent of batch here
BASE = WorkerPerf(base=PerfModel(k1=0.1, c1=10.0, k2=0.0, c2=0.0, c3=31.8))


def batch(n: int, rank: int, adapter: str = "a") -> tuple:
    return tuple(p.RunningRequest(request_id=f"{adapter}{k}", input_tokens=100, generated=10, rank=rank,
                                  adapter=adapter) for k in range(n))


def worker(wid: str, reqs: tuple, kernel: str, **kw) -> p.WorkerView:
    return p.WorkerView(worker_id=wid, requests=reqs, kernel=kernel, perf=BASE, **kw)


NEW64 = p.RequestView(request_id="n", input_tokens=100, adapter="a", adapter_rank=64)


def test_lora_model_matches_the_papers_example():
    # BGMV ∝ batch × max rank, MBGMV ∝ Σ rank (1.7 ms more base): 34.8/35.8 and 35.3/35.9 ms
    t = lambda k, b, mx, sm: c.step_ms(BASE, k, b, 100, mx, sm)  # noqa: E731
    assert t(BGMV, 24, 32, 768) == pytest.approx(34.8, abs=0.01)
    assert t(BGMV, 16, 64, 1024) == pytest.approx(35.8, abs=0.01)
    assert t(MBGMV, 24, 32, 768) == pytest.approx(35.3, abs=0.01)
    assert t(MBGMV, 16, 64, 1024) == pytest.approx(35.9, abs=0.01)
    assert LORA_DEFAULTS[BGMV][0] == pytest.approx(1 / 256)


@pytest.mark.parametrize("kernel, slo, expect", [(BGMV, 36.1, "inst2"), (MBGMV, 36.0, "inst1")])
def test_the_papers_two_instance_example(kernel, slo, expect):
    """Fig. 5: instance 1 runs 24 rank-32 requests, instance 2 16 rank-64; a rank-64 request
    must go to instance 2 under BGMV (instance 1 would pad 25 requests to 64) and to
    instance 1 under MBGMV (instance 2's Σrank would break the SLO)."""
    ws = [worker("inst1", batch(24, 32), kernel), worker("inst2", batch(16, 64), kernel)]
    req = p.RequestView(request_id="n", input_tokens=100, adapter="a", adapter_rank=64, atgt_slo_ms=slo)
    assert p.choose("caraserve", ws, req, p.PolicyState(), random.Random(0)).worker_id == expect
    costs = {w.worker_id: c.cost_of(w, req, c.CaraConfig(atgt_slo_ms=slo)) for w in ws}
    loser = ({"inst1", "inst2"} - {expect}).pop()
    assert costs[loser].violates and not costs[expect].violates


def test_picks_the_cheaper_rank_mix_without_slo_pressure():
    # same batch size; a rank-64 request costs little where 64 is already the max rank (BGMV)
    ws = [worker("low", batch(10, 8), BGMV), worker("high", batch(10, 64), BGMV)]
    cfg = c.CaraConfig(atgt_slo_ms=1e9)
    assert c.rank_aware(ws, NEW64, cfg).worker_id == "high"
    # a rank-8 request under MBGMV adds the same Σrank anywhere; the batch with the lower
    # per-step time (Σrank 80 < 640) is the cheaper one to join
    low8 = p.RequestView(request_id="n", input_tokens=100, adapter="a", adapter_rank=8)
    ws_m = [worker("low", batch(10, 8), MBGMV), worker("high", batch(10, 64), MBGMV)]
    assert c.rank_aware(ws_m, low8, cfg).worker_id == "low"


def test_slo_break_is_penalised_even_when_otherwise_cheaper():
    ws = [worker("small", batch(2, 64), BGMV), worker("big", batch(40, 8), BGMV)]
    cheap = c.rank_aware(ws, NEW64, c.CaraConfig(atgt_slo_ms=1e9))
    assert cheap.worker_id == "small"
    # with a 33 ms SLO, small's step goes to 31.8 + 3·64/256 = 32.55 (ok), big's to 31.8 + 41·64/256 = 42
    tight = c.rank_aware(ws, NEW64, c.CaraConfig(atgt_slo_ms=33.0))
    assert tight.worker_id == "small" and not tight.violates
    # make "small" the one that breaks the SLO: it now holds 30 rank-64 requests
    ws[0] = worker("small", batch(30, 64), BGMV)
    rank8 = p.RequestView(request_id="n", input_tokens=100, adapter_rank=8)
    got = c.rank_aware(ws, rank8, c.CaraConfig(atgt_slo_ms=42.0))
    assert got.worker_id == "big" and got.cost < c.PENALTY


def test_candidates_need_the_adapter_or_a_slot_and_kv_room():
    full_slots = worker("slots", (), BGMV, adapters=("x", "y"), adapter_ranks=(8, 8), max_adapters=2)
    has_it = worker("has", batch(20, 64), BGMV, adapters=("a",), adapter_ranks=(64,), max_adapters=1)
    no_kv = worker("nokv", (), BGMV, kv_used=990, kv_capacity=1000)
    cands = c.candidates([full_slots, has_it, no_kv], NEW64)
    assert [w.worker_id for w in cands] == ["has"]
    assert c.rank_aware([full_slots, has_it, no_kv], NEW64).worker_id == "has"


def test_least_loaded_and_first_fit_baselines():
    ws = [p.WorkerView(worker_id="w0", outstanding=3, kv_used=100, kv_capacity=1000, max_batch=4),
          p.WorkerView(worker_id="w1", outstanding=1, kv_used=800, kv_capacity=1000, max_batch=4),
          p.WorkerView(worker_id="w2", outstanding=2, kv_used=50, kv_capacity=1000, max_batch=4)]
    req = p.RequestView(request_id="r", input_tokens=100, predicted_tokens=50)
    rng, st = random.Random(0), p.PolicyState()
    assert p.choose("least_loaded", ws, req, st, rng).worker_id == "w2"  # least KV in use
    assert p.choose("first_fit", ws, req, st, rng).worker_id == "w0"  # first with a slot and KV room
    ws[0] = p.WorkerView(worker_id="w0", outstanding=4, kv_used=100, kv_capacity=1000, max_batch=4)
    assert p.choose("first_fit", ws, req, st, rng).worker_id == "w1"
    assert {"aladdin", "caraserve", "least_loaded", "first_fit"} <= set(p.POLICIES)
