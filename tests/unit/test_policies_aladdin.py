"""Aladdin best-fit placement (Alg. 1, constraints b-e), its scale-out signal, and
re-balancing on prediction error (Alg. 2)."""
from __future__ import annotations

import random

import pytest

from polyserve.core.perf import PerfModel, WorkerPerf
from polyserve.dispatcher import policy as p
from polyserve.dispatcher import policy_aladdin as a
from polyserve.dispatcher.live import RequestBook

pytestmark = pytest.mark.unit

# prefill 0.1 ms/token + 10 ms; decode (0.001·l_avg + 1)·b + 20 ms; KV 1 token per token
PERF = WorkerPerf(base=PerfModel(k1=0.1, c1=10.0, k2=0.001, c2=1.0, c3=20.0))
CFG = a.AladdinConfig(ttft_slo_ms=500.0, atgt_slo_ms=75.0, gamma=0.5, theta=0.9)


def running(n: int, l_in: int = 100, pred: int = 100, gen: int = 50, dec_ms: float = 0.0) -> tuple:
    return tuple(p.RunningRequest(request_id=f"x{k}", input_tokens=l_in, predicted_tokens=pred, generated=gen,
                                  decode_ms=dec_ms) for k in range(n))


def worker(wid: str, reqs: tuple = (), **kw) -> p.WorkerView:
    kw.setdefault("max_batch", 32)
    kw.setdefault("kv_capacity", 1_000_000)
    return p.WorkerView(worker_id=wid, requests=reqs, perf=PERF, **kw)


REQ = p.RequestView(request_id="new", input_tokens=100, predicted_tokens=100)


def test_picks_the_fullest_feasible_worker():
    ws = [worker("empty"), worker("half", running(10)), worker("full", running(32)), worker("most", running(20))]
    norms = {w.worker_id: a.capacity_norm(w, CFG) for w in ws}
    assert norms["full"] > norms["most"] > norms["half"] > norms["empty"]
    got = a.place(ws, REQ, CFG)
    assert got.worker_id == "most" and not got.scale_out  # "full" is at max_batch: refused
    assert got.reasons == {"full": "batch"}
    # the registered policy gives the same answer
    d = p.choose("aladdin", ws, REQ, p.PolicyState(), random.Random(0))
    assert d.worker_id == "most"


def test_signals_scale_out_when_no_worker_fits_and_the_policy_falls_back_to_the_emptiest():
    ws = [worker("a", running(32)), worker("b", running(31), max_batch=31)]
    got = a.place(ws, REQ, CFG)
    assert got.worker_id is None and got.scale_out and set(got.reasons.values()) == {"batch"}
    assert p.choose("aladdin", ws, REQ, p.PolicyState(), random.Random(0)).worker_id == "b"


def no_fit_cluster() -> tuple[list, p.RequestView]:
    """Three workers none of which passes Alg. 1 for a 1000-token prompt (prefill 110 ms)."""
    req = p.RequestView(request_id="n", input_tokens=1000, predicted_tokens=100)
    fresh = worker("fresh", running(1, gen=1, dec_ms=0.0))  # slack 75 ms: 0.9·75 < 110 ms
    old = worker("old", running(20, l_in=2000, gen=50, dec_ms=2000.0))  # slack 1750 ms, context over (b)
    queued = tuple(p.RunningRequest(request_id=f"q{k}", input_tokens=2000, predicted_tokens=50, started=False)
                   for k in range(2))
    backlog = worker("backlog", queued)  # prefill(4000 + 1000) = 510 ms > T_pre 500 ms
    return [fresh, old, backlog], req


def test_with_no_fit_the_request_goes_where_it_does_the_least_harm():
    ws, req = no_fit_cluster()
    got = a.place(ws, req, CFG)
    assert got.worker_id is None and got.reasons == {"fresh": "slack", "old": "atgt", "backlog": "ttft"}
    norms = {w.worker_id: a.capacity_norm(w, CFG) for w in ws}
    assert norms["fresh"] < norms["backlog"] < norms["old"]  # the emptiest would be "fresh"
    keys = {w.worker_id: a.fallback_key(w, req, CFG) for w in ws}
    assert keys["fresh"][:2] == (False, 1)  # its one request would lose its whole slack
    assert keys["old"][:2] == (False, 0) and keys["old"][2] == -(0.9 * 1750.0 - 110.0)
    assert keys["backlog"][0] is True  # the new prompt would wait past its TTFT SLO
    assert a.fallback(ws, req, CFG) == "old"
    d = a.aladdin_best_fit(ws, p.RequestView(request_id="n", input_tokens=1000, predicted_tokens=100,
                                             ttft_slo_ms=500.0, atgt_slo_ms=75.0), p.PolicyState(), None)
    assert d.worker_id == "old" and d.scale_out
    # among workers that hurt no ongoing request the larger slack margin wins, then the emptiest
    less = worker("less", running(20, l_in=2000, gen=50, dec_ms=3000.0))  # slack 750 ms
    assert a.fallback([less, ws[1]], req, CFG) == "old"
    assert a.fallback([worker("e1"), worker("e0")], req, CFG) == "e0"  # idle: lowest id


def test_atgt_constraint_b_bounds_batch_context():
    # l_d(b) = (75 - 20 - b)/0.001; 20 requests of 2000 + 0.5·100 = 41,000 tokens > 0.9·l_d(21) = 30,600
    heavy = worker("heavy", running(20, l_in=2000))
    assert a.check(heavy, REQ, CFG) == "atgt"
    assert a.check(worker("light", running(20, l_in=100)), REQ, CFG) == ""


def test_ttft_constraint_c_counts_requests_not_yet_prefilled():
    queued = tuple(p.RunningRequest(request_id=f"q{k}", input_tokens=2000, predicted_tokens=50, started=False)
                   for k in range(2))
    w = worker("w", queued)  # 4000 queued + 100 new tokens: 0.1·4100 + 10 = 420 ms <= 500
    assert a.check(w, REQ, CFG) == ""
    big = p.RequestView(request_id="big", input_tokens=1000, predicted_tokens=10)  # 510 ms > 500
    assert a.check(w, big, CFG) == "ttft"
    # a prompt that alone cannot meet the TTFT SLO may still go where nothing else waits
    huge = p.RequestView(request_id="huge", input_tokens=6000, predicted_tokens=10)
    assert a.check(worker("idle"), huge, CFG) == ""


def test_slack_constraint_d_protects_ongoing_requests():
    # banked slack = 75·gen - decode_ms: 75·2 - 140 = 10 ms; the new prefill takes 20 ms
    w = worker("w", running(3, gen=2, dec_ms=140.0))
    assert a.check(w, REQ, CFG) == "slack"
    assert a.check(worker("w", running(3, gen=2, dec_ms=100.0)), REQ, CFG) == ""  # 50 ms saved


def test_kv_peak_over_future_iterations():
    # (context now, steps left): peak when the long one is alone vs when both are alive
    assert a.kv_peak(PERF, [(100, 10), (50, 100)]) == max(100 + 10 + 50 + 10, 50 + 100)
    assert a.kv_peak(None, []) == 0.0


def test_a_kv_infeasible_placement_is_refused():
    # now: 2 × (100 + 50) = 300 tokens held; the new request brings 100 more (400: fits today),
    # but all three run 100 more steps: at the last one 2 × 250 + 200 = 700 tokens
    reqs = running(2, l_in=100, pred=150, gen=50)
    tight = worker("tight", reqs, kv_capacity=650)
    assert a.check(tight, REQ, CFG) == "kv"
    assert a.check(worker("roomy", reqs, kv_capacity=700), REQ, CFG) == ""
    got = a.place([tight], REQ, CFG)
    assert got.worker_id is None and got.reasons == {"tight": "kv"}


def test_underestimated_requests_are_re_predicted():
    r = p.RunningRequest(input_tokens=10, predicted_tokens=20, generated=30)
    assert a.planned_output(r, CFG) == 60  # default: twice what it generated
    cfg = a.AladdinConfig(repredict=lambda i, pr, g: g + 5)
    assert a.planned_output(r, cfg) == 35
    assert a.planned_output(p.RunningRequest(predicted_tokens=20, generated=5)) == 20


def test_rebalance_moves_queued_requests_from_underestimated_to_overestimated_workers():
    late = tuple(p.RunningRequest(request_id=f"o{k}", input_tokens=100, predicted_tokens=10, generated=40)
                 for k in range(3))  # outlived their predictions: worker "over" is overloaded
    queued = tuple(p.RunningRequest(request_id=f"q{k}", input_tokens=100, predicted_tokens=50, started=False)
                   for k in range(2))
    over = worker("over", late + queued)
    under = worker("under", running(2), len_error=-300.0, batch_error=-3.0)  # 3 finished early
    l_e, b_e = a.worker_error(over, CFG)
    assert b_e == 3 and l_e == 3 * (80 - 40)
    moves = a.rebalance([over, under], CFG)
    assert moves and all(m.src == "over" and m.dst == "under" for m in moves)
    assert {m.request_id for m in moves} <= {"q0", "q1"}
    # nothing to fix: no moves
    assert a.rebalance([worker("x", running(2)), worker("y", running(2))], CFG) == []


def test_error_ledger_and_request_book():
    led = a.ErrorLedger()
    led.finished("w", predicted=100, real=40, now=0.0, step_ms=50.0)  # predicted to run 3 s more
    led.finished("w", predicted=10, real=40, now=0.0, step_ms=50.0)  # ran longer: not an over-estimate
    assert led.errors("w", 1.0) == (-60.0, -1.0)
    assert led.errors("w", 4.0) == (0.0, 0.0)
    book = RequestBook()
    book.place("w1", p.RequestView(request_id="r", input_tokens=100, predicted_tokens=30, adapter_rank=8))
    (r,) = book.requests("w1", now=0.0, perf=PERF)
    assert not r.started and r.rank == 8
    book.first_token("r", now=10.0)
    (r,) = book.requests("w1", now=10.5, perf=PERF)  # step at b=1, ctx 100: (0.1 + 1) + 20 = 21.1 ms
    assert r.started and r.decode_ms == pytest.approx(500.0) and r.generated == 1 + int(500 / 21.1)
    book.finish("r", output_tokens=5, now=11.0, step_ms=50.0)
    assert book.requests("w1", 11.0, PERF) == () and book.ledger.errors("w1", 11.0)[1] == -1.0


def test_heartbeat_only_views_still_work():
    # no per-request detail and no perf: only batch and KV from the heartbeat are checked
    ws = [p.WorkerView(worker_id="a", running=3, kv_used=900, kv_capacity=1000),
          p.WorkerView(worker_id="b", running=1, kv_used=100, kv_capacity=1000)]
    assert p.choose("aladdin", ws, REQ, p.PolicyState(), random.Random(0)).worker_id == "b"  # a: KV full
    ws[0] = p.WorkerView(worker_id="a", running=3, kv_used=500, kv_capacity=1000)
    assert p.choose("aladdin", ws, REQ, p.PolicyState(), random.Random(0)).worker_id == "a"  # fuller, fits


def test_perf_models_are_fitted_online_from_the_profile_and_report_their_error():
    from polyserve.core.perf import PerfFitter

    fit = PerfFitter(PERF)
    assert fit.current().base == PERF.base  # starts from the profile
    assert fit.errors()["decode"]["mean_rel_err"] is None
    rng = random.Random(0)
    truth = WorkerPerf(base=PerfModel(k1=0.12, c1=15.0, k2=0.002, c2=1.5, c3=25.0))
    for _ in range(600):
        b, ctx, n = rng.randint(1, 48), rng.uniform(100, 3000), rng.randint(50, 6000)
        fit.observe_decode(ctx, b, truth.decode_ms(ctx, b))
        fit.observe_prefill(n, truth.prefill_ms(n))
        fit.observe_kv(int(ctx), truth.kv(ctx))
    got = fit.current().base
    assert got.k2 == pytest.approx(0.002, rel=0.02) and got.c3 == pytest.approx(25.0, rel=0.02)
    assert got.k1 == pytest.approx(0.12, rel=0.02) and got.c1 == pytest.approx(15.0, rel=0.1)
    err = fit.errors()
    assert err["decode"]["n"] == 600 and err["decode"]["mean_rel_err"] < 0.02  # the last 200: converged
    assert err["prefill"]["r2"] > 0.99
    # a completed event (ttft − queue ≈ its prefill) moves the prefill fit too
    before = fit.prefill.n
    fit.observe_completed(input_tokens=1000, output_tokens=20, ttft_ms=200.0, queue_ms=50.0, atgt_ms=40.0,
                          mean_batch=8, mean_context=1000)
    assert fit.prefill.n == before + 1 and fit.decode.n == 601


def test_max_tokens_caps_every_output_aladdin_plans_with():
    """A request's hard cap bounds its planned output: the new entry, a re-prediction once
    it outlives its prediction, and the book's estimate of what it generated so far."""
    req = p.RequestView(request_id="r", input_tokens=100, predicted_tokens=500, max_tokens=64)
    assert a.new_output(req) == 64 and a.as_new(req).predicted_tokens == 64 and a.as_new(req).max_tokens == 64
    assert a.new_output(p.RequestView(predicted_tokens=0, max_tokens=64)) == 1
    past = p.RunningRequest(input_tokens=100, predicted_tokens=20, generated=40, max_tokens=50)
    assert a.planned_output(past, CFG) == 50  # re-predicted 2 x 40 = 80, capped
    assert a.planned_output(p.RunningRequest(predicted_tokens=20, generated=40), CFG) == 80
    # a worker whose KV holds 100 + 64 tokens but not 100 + 500: the cap makes it fit
    w = p.WorkerView(worker_id="w", kv_capacity=200, requests=())
    assert a.check(w, req, CFG) == ""
    assert a.check(w, p.RequestView(request_id="r", input_tokens=100, predicted_tokens=500), CFG) == "kv"
    book = RequestBook()
    book.place("w", req)
    book.first_token("r", now=0.0)
    (r,) = book.requests("w", now=100.0, perf=PERF)  # 100 s of decoding: far past its cap
    assert r.generated == 64 and a.planned_output(r, CFG) == 64
