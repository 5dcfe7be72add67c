"""The planner's autoscalers in the simulator (SIMULATED): each scales out under a load
step and back in, per-token and request latency HPA decide differently, µ-Serve's
scale-out signal comes from MIAD at the maximum clock, stopped workers lose no
request, the CLI reports and plots them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyserve.core.perf import PerfModel, WorkerPerf
from polyserve.planner.autoscalers import HpaScaler, MuServeScaler, TargetTracking
from polyserve.simulator import report
from polyserve.simulator.autoscale import auto_thresholds, load_rise
from polyserve.simulator.cli import main as cli_main
from polyserve.simulator.cluster import SimConfig, simulate
from polyserve.simulator.trace import from_requests

pytestmark = pytest.mark.unit

# prefill = Σl_in + 10 ms; decode step = 2·b + 5 ms
PERF = WorkerPerf(base=PerfModel(k1=1.0, c1=10.0, k2=0.0, c2=2.0, c3=5.0))
FAST = dict(planner_period_s=5.0, scaler_window_s=30.0, stabilization_s=10.0, cold_start_s=5.0, max_workers=8,
            tracking_hold_s=20.0, muserve_idle_release_s=20.0)


def _poisson(rate: float, t0: float, t1: float, inp: int, out: int, seed: int) -> list[tuple[float, int, int]]:
    rng = np.random.default_rng(seed)
    t = t0 + np.cumsum(rng.exponential(1.0 / rate, size=int(rate * (t1 - t0) * 1.5) + 10))
    return [(float(a), inp, out) for a in t[t < t1]]


def _step_trace():
    """1 req/s for 60 s, 12 req/s for 60 s (one worker cannot keep up), then 0.2 req/s for 200 s."""
    return from_requests(_poisson(1.0, 0.0, 60.0, 100, 50, 0) + _poisson(12.0, 60.0, 120.0, 100, 50, 1)
                         + _poisson(0.2, 120.0, 320.0, 100, 50, 2))


@pytest.mark.parametrize("scaler", ["pertoken", "request", "target_tracking", "muserve"])
def test_each_autoscaler_scales_out_under_a_load_step_and_back_in(scaler):
    res = simulate(_step_trace(), PERF, SimConfig(autoscaler=scaler, pertoken_threshold_ms=25.0,
                                                  request_threshold_ms=1000.0, tracking_slo_ms=40.0,
                                                  atgt_slo_ms=20.0, **FAST))
    x = res.extra
    up = dict(res.timeline)
    assert x["first_scale_out_s"] is not None and 60.0 <= x["first_scale_out_s"] <= 90.0
    assert max(up.values()) >= 2 and res.timeline[-1][1] == 1  # out, then back to the minimum
    assert x["scale_outs"] >= 1 and x["scale_ins"] >= 1
    assert x["load_rise_s"] == pytest.approx(60.0)
    assert x["scale_out_after_rise_s"] == pytest.approx(x["first_scale_out_s"] - 60.0)
    # every request served: a stopped worker hands its queue back and finishes its running ones
    assert all(r.finish >= 0 and not r.rejected for r in res.requests)
    m = report.metrics(res)
    assert m["autoscaler"] == x["autoscaler"] and m["workers_peak"] == max(up.values())
    assert 1.0 * res.horizon_s < res.gpu_seconds < max(up.values()) * res.horizon_s


def test_per_token_and_request_latency_hpa_decide_differently():
    # long outputs at a light load: request latency is high (≈ 400 × 7 ms) though every token is fast
    tr = from_requests(_poisson(0.5, 0.0, 120.0, 100, 400, 3))
    runs = {k: simulate(tr, PERF, SimConfig(autoscaler=k, pertoken_threshold_ms=15.0, request_threshold_ms=1500.0,
                                            **FAST)) for k in ("pertoken", "request")}
    assert runs["pertoken"].extra["scale_outs"] == 0 and runs["pertoken"].gpus_peak == 1
    assert runs["request"].extra["scale_outs"] >= 1 and runs["request"].gpus_peak >= 2
    d_tok = [d for _, _, d in runs["pertoken"].extra["decisions"]]
    d_req = [d for _, _, d in runs["request"].extra["decisions"]]
    assert d_tok != d_req


def test_the_simulator_drives_the_planners_own_scaler_objects():
    from polyserve.simulator.cluster import Cluster

    tr = _step_trace()
    kinds = {"pertoken": HpaScaler, "request": HpaScaler, "target_tracking": TargetTracking, "muserve": MuServeScaler,
             "tracking": TargetTracking, "museserve": MuServeScaler}  # older spellings accepted on input
    for name, cls in kinds.items():
        c = Cluster(tr, PERF, SimConfig(autoscaler=name, **FAST))
        assert type(c.planner.scaler) is cls
    assert Cluster(tr, PERF, SimConfig(autoscaler="muserve")).clock.mode == "max"  # MIAD pinned: the signal exists


def test_muserve_scales_out_only_on_the_max_clock_signal():
    tr = _step_trace()
    res = simulate(tr, PERF, SimConfig(autoscaler="muserve", atgt_slo_ms=20.0, **FAST))
    assert res.extra["miad_decisions"]["scale_out"] >= 1 and res.extra["scale_outs"] >= 1
    # with loose SLOs the GPU never misses at max clock: no signal, no scale-out
    loose = simulate(tr, PERF, SimConfig(autoscaler="muserve", atgt_slo_ms=10_000.0, ttft_slo_ms=1e9, **FAST))
    assert loose.extra["miad_decisions"]["scale_out"] == 0 and loose.extra["first_scale_out_s"] is None


def test_auto_thresholds_and_load_rise():
    th = auto_thresholds(np.array([1, 11]), ttft_slo_ms=100.0, atgt_slo_ms=10.0, factor=0.5)
    # budgets 100 ms and 200 ms; per token 100 and 200/11
    assert th.request_ms == pytest.approx(0.5 * 150.0)
    assert th.pertoken_ms == pytest.approx(0.5 * (100.0 + 200.0 / 11) / 2)
    assert th.tracking_slo_ms == pytest.approx((100.0 + 200.0 / 11) / 2)
    assert auto_thresholds(np.array([5]), 100.0, 10.0, pertoken_ms=7.0).pertoken_ms == 7.0
    arr = np.concatenate([np.arange(0, 120, 1.0), np.arange(120, 180, 0.25)])
    assert load_rise(arr, 15.0, 1.25) == pytest.approx(120.0)
    assert load_rise(np.arange(0, 300, 1.0), 15.0, 1.25) is None


def test_bad_autoscaler_settings_say_what_to_fix():
    with pytest.raises(ValueError, match="autoscaler 'hpa' is unknown"):
        SimConfig(autoscaler="hpa").validate()
    with pytest.raises(ValueError, match="exclusive"):
        SimConfig(autoscaler="pertoken", autoscale=True).validate()


def test_cli_compares_autoscalers_in_one_table_and_plots_workers(tmp_path: Path):
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    tr = _step_trace()
    for t, i, o in zip(tr.arrival.tolist(), tr.input_len.tolist(), tr.output_len.tolist()):
        rows.append(f"2023-11-16 18:{int(t // 60):02d}:{t % 60:010.7f},{i},{o}")
    csv = tmp_path / "step.csv"
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    rc = cli_main(["--trace", str(csv), "--autoscaler", "pertoken,request,target_tracking,muserve",
                   "--planner-period-s", "5",
                   "--scaler-window-s", "30", "--cold-start-s", "5", "--max-workers", "8", "--atgt-slo-ms", "20",
                   "--pertoken-threshold-ms", "25", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["autoscaler"] for r in data["rows"]] == ["hpa-pertoken", "hpa-request", "target_tracking", "muserve"]
    for r in data["rows"]:
        assert r["viol_any"] >= r["viol_ttft"] and r["gpu_seconds"] > 0 and r["workers_peak"] >= 1
    assert data["rows"][0]["scaler"]["threshold_ms"] == 25.0
    assert (out / "workers_step_x1.png").exists()
    assert "1st scale-out" in (out / "results.txt").read_text()


def test_start_above_the_minimum_and_scale_in_to_it():
    tr = from_requests(_poisson(0.5, 0.0, 150.0, 100, 50, 4))
    res = simulate(tr, PERF, SimConfig(autoscaler="target_tracking", workers=1, initial_workers=3,
                                       tracking_slo_ms=40.0, **FAST))
    assert res.timeline[0][1] >= 1 and max(n for _, n in res.timeline) == 3
    assert res.timeline[-1][1] == 1 and res.extra["scale_ins"] == 2 and res.extra["first_scale_out_s"] is None
    with pytest.raises(ValueError, match="initial_workers"):
        SimConfig(autoscaler="target_tracking", workers=2, initial_workers=1).validate()
