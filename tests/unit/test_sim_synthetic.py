"""Follow-ups to the simulator's autoscaler/MIAD experiments (all SIMULATED): synthetic
load-step traces (rates, lengths drawn from a real trace, the step time carried to the
"first scale-out after the rise" figure), the per-token HPA fed with in-flight requests,
and MIAD's automatic clock floor."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from polyserve.core.perf import PerfModel, WorkerPerf
from polyserve.gpu_agent import gpu_model
from polyserve.simulator import power as pw
from polyserve.simulator import report
from polyserve.simulator.cli import main as cli_main
from polyserve.simulator.cluster import SimConfig, simulate
from polyserve.simulator.trace import (
    from_requests,
    load_azure_llm,
    load_trace,
    parse_synthetic,
    synthetic_step,
    window,
    write_azure_csv,
)

pytestmark = pytest.mark.unit

# prefill = Σl_in + 10 ms; decode step = 2·b + 5 ms
PERF = WorkerPerf(base=PerfModel(k1=1.0, c1=10.0, k2=0.0, c2=2.0, c3=5.0))
H100 = gpu_model.H100_80GB
LENGTHS = from_requests([(float(k), 50 + 10 * k, 5 + k) for k in range(20)], "lengths")


def test_synthetic_step_has_the_two_rates_and_draws_length_pairs_from_the_source():
    tr = synthetic_step(2.0, 10.0, at_s=100.0, duration_s=300.0, lengths=LENGTHS, seed=4)
    before = np.count_nonzero(tr.arrival < 100.0)
    after = np.count_nonzero(tr.arrival >= 100.0)
    assert abs(before - 200) < 4 * math.sqrt(200) and abs(after - 2000) < 4 * math.sqrt(2000)
    assert tr.step_s == 100.0 and tr.arrival.max() < 300.0 and np.all(np.diff(tr.arrival) >= 0)
    pairs = set(zip(LENGTHS.input_len.tolist(), LENGTHS.output_len.tolist()))
    assert set(zip(tr.input_len.tolist(), tr.output_len.tolist())) <= pairs
    assert len(set(tr.input_len.tolist())) > 10  # drawn, not one repeated pair
    again = synthetic_step(2.0, 10.0, at_s=100.0, duration_s=300.0, lengths=LENGTHS, seed=4)
    other = synthetic_step(2.0, 10.0, at_s=100.0, duration_s=300.0, lengths=LENGTHS, seed=5)
    assert np.array_equal(tr.arrival, again.arrival) and not np.array_equal(tr.arrival, other.arrival)


def test_a_ramp_rises_linearly():
    tr = synthetic_step(0.0, 20.0, at_s=0.0, duration_s=400.0, ramp_s=400.0, lengths=LENGTHS, seed=1)
    first, second = np.count_nonzero(tr.arrival < 200.0), np.count_nonzero(tr.arrival >= 200.0)
    # rate 20·t/400: 1,000 arrivals expected in the first half, 3,000 in the second
    assert abs(first - 1000) < 4 * math.sqrt(1000) and abs(second - 3000) < 4 * math.sqrt(3000)


@pytest.mark.parametrize("spec, msg", [("synthetic:ramp:1:2:3:4", "expected synthetic:step"),
                                       ("synthetic:step:1:2:3", "expected synthetic:step"),
                                       ("synthetic:step:a:2:3:4", "must be a number"),
                                       ("synthetic:step:1:2:50:40", "AT_S < DURATION_S"),
                                       ("synthetic:step:1:0:5:40", "PEAK > 0")])
def test_bad_synthetic_specs_say_what_to_fix(spec, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        load_trace(spec, write_azure_csv(LENGTHS, tmp_path / "l.csv"))


def test_load_trace_reads_lengths_from_an_azure_csv_and_window_rescales_the_step(tmp_path):
    csv_path = write_azure_csv(LENGTHS, tmp_path / "lengths.csv")
    back = load_azure_llm(csv_path)  # the CSV writer round-trips
    assert np.allclose(back.arrival, LENGTHS.arrival) and np.array_equal(back.output_len, LENGTHS.output_len)
    tr = load_trace("synthetic:step:1:4:60:240:30", csv_path, seed=2)
    assert parse_synthetic("synthetic:step:1:4:60:240:30")["ramp_s"] == 30.0
    assert tr.step_s == 60.0 and tr.name == "step1to4ramp30"
    w = window(tr, rate_scale=2.0)
    assert w.step_s == pytest.approx((60.0 - tr.arrival[0]) / 2.0)
    assert window(tr, duration_s=30.0).step_s is None  # the step lies beyond the cut


def test_the_step_time_is_the_rise_and_scale_out_is_measured_from_it():
    tr = synthetic_step(1.0, 12.0, at_s=60.0, duration_s=180.0, lengths=from_requests([(0.0, 100, 50)]), seed=0)
    res = simulate(tr, PERF, SimConfig(autoscaler="pertoken", pertoken_threshold_ms=25.0, atgt_slo_ms=20.0,
                                       planner_period_s=5.0, cold_start_s=5.0, max_workers=8))
    x = res.extra
    assert x["load_rise_s"] == 60.0
    outs = [t for t, cur, want in x["decisions"] if want > cur]
    first_after = min(t for t in outs if t >= 60.0)
    assert x["rise_to_scale_out_s"] == pytest.approx(first_after - 60.0)
    assert 0.0 <= x["rise_to_scale_out_s"] <= 30.0
    assert report.metrics(res)["rise_to_scale_out_s"] == x["rise_to_scale_out_s"]


def test_live_per_token_samples_let_the_hpa_see_requests_that_have_not_completed():
    # 40 long requests at once: ~85 ms per token, none completes for minutes, so the window of
    # completed requests stays empty; only the in-flight per-token latency shows the overload
    tr = from_requests([(0.1 * k, 100, 2000) for k in range(40)])
    cfg = SimConfig(autoscaler="pertoken", pertoken_threshold_ms=30.0, planner_period_s=5.0, cold_start_s=5.0,
                    max_workers=8, scaler_window_s=30.0)
    off = simulate(tr, PERF, cfg).extra
    on = simulate(tr, PERF, SimConfig(**{**cfg.__dict__, "live_pertoken": True})).extra
    assert off["first_scale_out_s"] is None or off["first_scale_out_s"] > 60.0
    assert on["first_scale_out_s"] is not None and on["first_scale_out_s"] <= 10.0


def test_auto_floor_is_the_lowest_clock_prefilling_the_quantile_prompt_within_the_slo():
    lens = np.array([100] * 999 + [1000])
    f = pw.auto_floor(H100, PERF, lens, ttft_slo_ms=2000.0, threshold=0.05, quantile=99.95)
    # P99.95 of the lengths is the 1,000-token prompt: 1,010 ms at the maximum clock, budget 0.95·2000 ms
    assert f["prompt_tokens"] == 1000 and f["budget_ms"] == pytest.approx(1900.0)
    assert f["mhz"] == math.ceil(1010.0 / 1900.0 * H100.max_mhz)
    assert f["prefill_ms_at_floor"] <= 1900.0 < 1010.0 / H100.frac(f["mhz"] - 1)
    low = pw.auto_floor(H100, PERF, lens, ttft_slo_ms=2000.0, quantile=50.0)  # the 100-token median
    assert low["mhz"] == max(H100.min_mhz, math.ceil(110.0 / 1900.0 * H100.max_mhz))
    assert pw.auto_floor(H100, PERF, lens, ttft_slo_ms=500.0, quantile=100.0)["mhz"] == H100.max_mhz  # none fits


def test_miad_with_the_auto_floor_never_goes_below_it(tmp_path):
    rng = np.random.default_rng(0)
    t = np.cumsum(rng.exponential(0.5, size=200))
    tr = from_requests([(float(a), int(rng.choice([100, 200, 800])), 20) for a in t])
    res = simulate(tr, PERF, SimConfig(clock="miad", miad_min_mhz="auto", ttft_slo_ms=2000.0, atgt_slo_ms=60.0))
    x = res.extra
    floor = x["miad_auto_floor"]["mhz"]
    assert floor == pw.auto_floor(H100, PERF, tr.input_len, 2000.0, quantile=99.9)["mhz"]
    assert x["miad_floor_mhz"] == floor and min(x["clock_min_mhz"]) >= floor
    assert min(x["clock_min_mhz"]) < H100.max_mhz  # it did lower the clock
    m = report.metrics(res)
    assert m["miad_min_mhz"] == "auto" and m["miad_floor_mhz"] == floor
    with pytest.raises(ValueError, match="'auto'"):
        SimConfig(miad_min_mhz="lowest").validate()


def test_cli_runs_a_synthetic_step_with_threshold_factors_live_and_the_auto_floor(tmp_path, capsys):
    csv_path = write_azure_csv(from_requests([(float(k), 200 + 50 * k, 20 + k) for k in range(30)]),
                               tmp_path / "l.csv")
    out = tmp_path / "out"
    rc = cli_main(["--trace", "synthetic:step:0.5:4:60:180", "--synthetic-lengths", str(csv_path),
                   "--autoscaler", "pertoken,request", "--threshold-factor", "0.6,1", "--live-pertoken", "off,on",
                   "--cold-start-s", "20", "--max-workers", "6", "--no-plots", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert sorted(r["label"] for r in rows) == sorted(
        f"least_outstanding/{k}" for k in ("pertoken@0.6", "pertoken@0.6+live", "pertoken@1", "pertoken@1+live",
                                           "request@0.6", "request@1"))
    assert all(r["load_rise_s"] is not None and r["trace"] == "step0.5to4" for r in rows)
    text = capsys.readouterr().out
    assert "rise to next" in text
    rc = cli_main(["--trace", "synthetic:step:0.5:2:60:120", "--synthetic-lengths", str(csv_path), "--workers", "2",
                   "--clock", "max,miad", "--miad-min-mhz", "0,auto", "--no-plots", "--out", str(tmp_path / "m")])
    assert rc == 0
    rows = json.loads((tmp_path / "m" / "results.json").read_text())["rows"]
    auto = next(r for r in rows if r["miad_min_mhz"] == "auto")
    assert auto["label"].endswith("miad>=autoMHz") and auto["miad_floor_mhz"] > H100.min_mhz
    assert cli_main(["--trace", "synthetic:step:1:2", "--no-plots", "--out", str(tmp_path / "x")]) == 2
