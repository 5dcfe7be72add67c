"""The trace-driven simulator: hand-checked latencies on one worker, KV behaviour,
determinism, the dispatcher's own policies, the CLI's outputs, the trace inputs."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from polyserve.core.perf import PerfModel, WorkerPerf
from polyserve.dispatcher import policy as dispatch_policy
from polyserve.simulator import cluster, simulate_requests
from polyserve.simulator.cli import main as cli_main
from polyserve.simulator.engine import WorkerConfig
from polyserve.simulator.predictor import ConditionalMean, LengthPredictor, percentile_bounds
from polyserve.simulator.trace import from_requests, load_azure_llm, make_adapters, window

pytestmark = pytest.mark.unit

# prefill = Σl_in + 10 ms; decode step = 2·b + 5 ms (k2 = 0: context does not matter)
PERF = WorkerPerf(base=PerfModel(k1=1.0, c1=10.0, k2=0.0, c2=2.0, c3=5.0))
DATASETS = Path(__file__).resolve().parents[3] / "shared" / "datasets"
CONV = DATASETS / "traces" / "azure_llm_2023_conv.csv"
FUNCS = DATASETS / "traces" / "azure_functions_2019_sample1000_invocations.csv"


def test_single_request_ttft_is_its_prefill_and_atgt_its_decode_step():
    (r,) = simulate_requests([(1.0, 100, 5)], PERF)
    assert r.ttft_ms == pytest.approx(110.0)  # 100 + 10
    assert r.atgt_ms == pytest.approx(7.0)  # 2·1 + 5, four decode steps
    assert r.e2e_ms == pytest.approx(110.0 + 4 * 7.0)
    assert r.queue_ms == 0.0 and r.arrival_s == 1.0


def test_requests_arriving_together_share_a_prefill_then_decode_together():
    a, b = simulate_requests([(0.0, 100, 3), (0.0, 50, 2)], PERF)
    assert a.ttft_ms == b.ttft_ms == pytest.approx(160.0)  # one prefill of 150 tokens
    assert b.e2e_ms == pytest.approx(160.0 + 9.0)  # one step at b = 2
    assert a.e2e_ms == pytest.approx(160.0 + 9.0 + 7.0)  # then alone at b = 1
    assert a.atgt_ms == pytest.approx(8.0) and b.atgt_ms == pytest.approx(9.0)


def test_a_request_arriving_mid_step_waits_for_the_step_to_end():
    # r1's first decode step runs 110..117 ms; r2 arrives at 112 and is prefilled at 117 (60 ms)
    r1, r2 = simulate_requests([(0.0, 100, 10), (0.112, 50, 3)], PERF)
    assert r2.ttft_ms == pytest.approx(117.0 + 60.0 - 112.0)
    assert r2.queue_ms == pytest.approx(5.0)
    # r1's second token waited for r2's prefill plus its own step: 60 + 7
    assert r1.e2e_ms > 110 + 9 * 7.0


def test_prefill_token_budget_splits_prefills():
    # vLLM's max_num_batched_tokens: 80 + 80 > 100, so r2 waits for the next step, which also
    # decodes r1: r2's first token at 90 (r1's prefill) + 90 (its own)
    r1, r2 = simulate_requests([(0.0, 80, 5), (0.0, 80, 5)], PERF, max_prefill_tokens=100)
    assert r1.ttft_ms == pytest.approx(90.0) and r2.ttft_ms == pytest.approx(180.0)
    a, b = simulate_requests([(0.0, 80, 5), (0.0, 80, 5)], PERF)  # no budget: one prefill
    assert a.ttft_ms == b.ttft_ms == pytest.approx(170.0)


def test_reserve_kv_queues_and_grow_kv_preempts():
    reqs = [(0.0, 100, 100), (0.0, 100, 100)]
    a, b = simulate_requests(reqs, PERF, kv_mode="reserve", kv_capacity=300)  # 200 each: one at a time
    assert b.ttft_ms > a.e2e_ms
    trace = from_requests(reqs)
    cfg = cluster.SimConfig(worker=WorkerConfig(kv_capacity=300, kv_mode="grow"))
    res = cluster.simulate(trace, PERF, cfg)
    assert res.counters["preemptions"] >= 1
    assert all(r.finish > 0 and not r.rejected for r in res.requests)
    # the preempted one kept its first-token time and still produced all its tokens
    late = max(res.requests, key=lambda r: r.finish)
    assert late.preemptions >= 1 and late.first_token < res.requests[0].finish


def test_queue_bound_and_prompt_limits_reject_with_a_reason():
    out = simulate_requests([(0.0, 100, 50)] * 4, PERF, max_batch=1, max_waiting=2)  # all queued at t=0
    assert [bool(r.rejected) for r in out] == [False, False, True, True]
    assert "queue full" in out[3].rejected and math.isnan(out[3].ttft_ms)
    (r,) = simulate_requests([(0.0, 500, 5)], PERF, kv_mode="grow", kv_capacity=100)
    assert "KV" in r.rejected


def _synthetic(n: int = 300, rate: float = 20.0, seed: int = 3):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return from_requests(list(zip(t, rng.integers(20, 400, n), rng.integers(2, 120, n))), "synthetic")


@pytest.mark.parametrize("policy", ["power_of_two", "aladdin_rebalance", "caraserve"])
def test_deterministic_with_a_seed(policy):
    trace = _synthetic()
    pred = LengthPredictor("confusion", trace.output_len, seed=1)
    cfg = cluster.SimConfig(policy=policy, workers=3, seed=5, worker=WorkerConfig(kv_capacity=20_000))
    lat = lambda res: [(r.worker, r.first_token, r.finish) for r in res.requests]  # noqa: E731
    a = cluster.simulate(trace, PERF, cfg, predictor=pred)
    b = cluster.simulate(trace, PERF, cfg, predictor=LengthPredictor("confusion", trace.output_len, seed=1))
    assert lat(a) == lat(b)
    assert all(r.finish > 0 for r in a.requests)


def test_the_simulator_calls_the_dispatchers_policies_and_worker_orders(monkeypatch):
    from polyserve.simulator import placement

    assert cluster.POLICIES is dispatch_policy.POLICIES and placement.POLICIES is dispatch_policy.POLICIES
    seen = []
    original = dispatch_policy.POLICIES["round_robin"]  # POLICIES is frozen: spy on the simulator's reference
    monkeypatch.setattr(placement, "POLICIES",
                        {**dispatch_policy.POLICIES, "round_robin": lambda *a: seen.append(1) or original(*a)})
    simulate_requests([(0.0, 10, 3), (0.0, 10, 3), (0.0, 10, 3)], PERF, workers=2, policy="round_robin")
    monkeypatch.undo()
    assert len(seen) == 3
    # oracle SJF on one busy worker: the shortest job of the queue goes first
    out = simulate_requests([(0.0, 10, 50), (0.001, 10, 40), (0.002, 10, 3)], PERF, max_batch=1,
                            order="sjf_oracle")
    assert out[2].e2e_ms < out[1].e2e_ms


def test_aladdin_autoscale_opens_and_releases_workers():
    trace = _synthetic(n=400, rate=40.0)
    cfg = cluster.SimConfig(policy="aladdin", workers=1, autoscale=True, idle_release_s=0.5,
                            ttft_slo_ms=300.0, atgt_slo_ms=40.0, worker=WorkerConfig(max_batch=8, kv_capacity=50_000))
    res = cluster.simulate(trace, PERF, cfg, predictor=LengthPredictor("oracle", trace.output_len))
    assert res.counters["scale_outs"] >= 1 and res.counters["workers_opened"] == 1 + res.counters["scale_outs"]
    assert res.gpus_peak > 1 and res.gpu_seconds < res.gpus_peak * res.horizon_s


def test_aladdin_autoscale_fills_cold_starting_workers_before_opening_more():
    """With a cold start, a request that fits nowhere ready goes to a worker still starting
    when it fits there: one shortfall opens one worker, not one per request."""
    trace = from_requests([(0.0, 50, 100), (0.01, 50, 100), (0.02, 50, 100), (0.03, 50, 100)], "burst")
    cfg = cluster.SimConfig(policy="aladdin", workers=1, autoscale=True, cold_start_s=5.0, idle_release_s=60.0,
                            worker=WorkerConfig(max_batch=2, kv_capacity=50_000))
    res = cluster.simulate(trace, PERF, cfg, predictor=LengthPredictor("oracle", trace.output_len))
    # two fill the ready worker; the third opens a worker; the fourth waits on that one
    assert res.counters["workers_opened"] == 2 and res.counters["scale_outs"] == 1
    assert sorted(r.worker for r in res.requests).count(res.requests[2].worker) == 2


def test_predictors_and_conditional_mean():
    out = np.array([10, 20, 30, 40, 1000] * 20)
    bounds = percentile_bounds(out)
    assert list(bounds) == sorted(set(bounds)) and len(bounds) == 4
    oracle = LengthPredictor("oracle", out)
    tok, cls = oracle.precompute(out)
    assert (tok == out).all() and cls.max() <= 4
    cm = ConditionalMean(out)
    assert cm(0, 10, 35) == round((40 * 20 + 1000 * 20) / 40)
    assert cm(0, 10, 5000) == 5001
    with pytest.raises(ValueError):
        LengthPredictor("nope", out)


def test_cli_writes_table_json_and_plots(tmp_path: Path):
    trace = tmp_path / "tiny.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rng = np.random.default_rng(0)
    for k in range(80):
        rows.append(f"2023-11-16 18:15:{k // 4:02d}.{(k % 4) * 25:02d}00000,{rng.integers(50, 800)},"
                    f"{rng.integers(5, 200)}")
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    rc = cli_main(["--trace", str(trace), "--policy", "least_outstanding,aladdin", "--rate-scale", "1,2",
                   "--workers", "1", "--out", str(out)])
    assert rc == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["simulated"] is True and len(payload["rows"]) == 4
    need = {"slo_ttft", "slo_atgt", "ttft_ms", "atgt_ms", "e2e_ms", "gpus_peak", "gpu_seconds"}
    assert need <= set(payload["rows"][0])
    assert (out / "results.txt").read_text().startswith("SIMULATED")
    assert {p.name for p in out.glob("*.png")} >= {"cdf_tiny_x1.png", "slo_vs_load_tiny.png", "gpus_vs_load_tiny.png"}
    assert cli_main(["--trace", str(trace), "--policy", "nope", "--out", str(out), "--no-plots"]) == 2


@pytest.mark.skipif(not CONV.exists(), reason=f"dataset not present: {CONV}")
def test_azure_trace_window_and_rate_scale():
    full = load_azure_llm(CONV)
    assert len(full) == 19366 and full.arrival[0] == 0.0 and 3500 < full.duration_s < 3700
    fast = window(full, start_s=600, end_s=1200, rate_scale=2.0, duration_s=100)
    assert fast.arrival[-1] <= 100 and abs(fast.rate / window(full, start_s=600, end_s=1200).rate - 2) < 0.1


def test_csv_traces_under_other_column_names_load_and_a_wrong_one_says_what_it_needs(tmp_path: Path):
    burst = tmp_path / "burstgpt.csv"  # BurstGPT's layout: seconds, a model column, a failed request's 0 output
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "45,GPT-4,1087,0,1087,Conversation log\n5,ChatGPT,472,18,490,Conversation log\n")
    tr = load_azure_llm(burst)
    assert tr.arrival.tolist() == [0.0, 40.0] and tr.input_len.tolist() == [472, 1087]
    assert tr.output_len.tolist() == [18, 1]
    iso = tmp_path / "iso.csv"
    iso.write_text("arrival_time,input_tokens,output_tokens\n2024-05-01T10:00:00.5Z,10,3\n2024-05-01T10:00:02Z,20,4\n")
    assert load_azure_llm(iso).arrival.tolist() == [0.0, 1.5]
    bad = tmp_path / "bad.csv"
    bad.write_text("when,in,out\n1,2,3\n")
    with pytest.raises(ValueError, match=r"no arrival time column; a CSV trace needs one of TIMESTAMP.*its header: when, in, out"):
        load_azure_llm(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,many,3\n")
    with pytest.raises(ValueError, match="line 3: cannot read"):
        load_azure_llm(bad)
    from polyserve.simulator.workloads import load_mooncake
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"ts": 5}\n')
    with pytest.raises(ValueError, match="line 2: a Mooncake trace line is a JSON object with timestamp"):
        load_mooncake(jl)


@pytest.mark.skipif(not FUNCS.exists(), reason=f"dataset not present: {FUNCS}")
def test_adapters_from_azure_functions_popularity():
    ads = make_adapters(FUNCS, n=100, ranks=(8, 16, 32, 64), seed=0)
    assert len(ads) == 100 and set(ads.ranks.tolist()) <= {8, 16, 32, 64}
    assert ads.probs.sum() == pytest.approx(1.0) and (np.diff(ads.probs) <= 0).all()
    assert ads.probs[0] > 10 * ads.probs[-1]  # heavily skewed, as CaraServe notes


def test_search_finds_the_fewest_workers_meeting_the_target():
    from polyserve.simulator.cli import _search
    from polyserve.simulator.report import metrics

    trace = _synthetic(n=200, rate=8.0)  # needs 4 workers for 95% (3 give 80%)
    cfg = cluster.SimConfig(policy="least_outstanding", workers=1, ttft_slo_ms=800.0, atgt_slo_ms=40.0,
                            worker=WorkerConfig(max_batch=8, kv_capacity=50_000))
    res, m, n = _search(trace, PERF, cfg, 0.95, 64)
    assert n == 4 and m["slo_both"] >= 0.95 and not res.counters["aborted"]
    fewer = metrics(cluster.simulate(trace, PERF, cluster.SimConfig(**{**cfg.__dict__, "workers": n - 1})))
    assert fewer["slo_both"] < 0.95


def test_policies_can_use_models_fitted_online():
    trace = _synthetic(n=200)
    wrong = WorkerPerf(base=PerfModel(k1=2.0, c1=20.0, k2=0.0, c2=4.0, c3=10.0))  # twice too slow
    cfg = cluster.SimConfig(policy="aladdin", workers=2, fit_online=True, tick_s=0.2,
                            worker=WorkerConfig(kv_capacity=50_000))
    res = cluster.simulate(trace, PERF, cfg, policy_perf=wrong, predictor=LengthPredictor("oracle", trace.output_len))
    assert res.fit_errors["decode"]["n"] > 0 and res.fit_errors["prefill"]["n"] > 0
