"""Clocks and energy in the simulator (all SIMULATED): step times follow gpu_model's
latency curve, energy is the integral of gpu_model.power_w over the run (hand-checked),
MIAD lowers power against the maximum clock at a light load and keeps the SLOs, the
clock series is recorded, the CLI reports and plots it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyserve.core.perf import PerfModel, WorkerPerf
from polyserve.core.queue_order import ORDER_KEYS
from polyserve.gpu_agent import gpu_model
from polyserve.simulator import report
from polyserve.simulator.cli import main as cli_main
from polyserve.simulator.cluster import SimConfig, simulate
from polyserve.simulator.engine import SimRequest, SimWorker, WorkerConfig
from polyserve.simulator.trace import from_requests

pytestmark = pytest.mark.unit

# prefill = Σl_in + 10 ms; decode step = 2·b + 5 ms
PERF = WorkerPerf(base=PerfModel(k1=1.0, c1=10.0, k2=0.0, c2=2.0, c3=5.0))
H100 = gpu_model.H100_80GB


def _poisson(rate: float, duration: float, inp: int, out: int, seed: int = 0) -> list[tuple[float, int, int]]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration * 1.5)))
    return [(float(a), inp, out) for a in t[t < duration]]


@pytest.mark.parametrize("x, ttft_ms, step_ms", [(1.0, 110.0, 7.0), (0.5, 220.0, 7.0), (0.15, 110.0 / 0.15, 14.0)])
def test_step_times_follow_the_latency_curve(x, ttft_ms, step_ms):
    # prefill is compute bound (∝ 1/x); decode is memory bound: flat down to the knee (0.3), then ∝ knee/x
    w = SimWorker("w", PERF, WorkerConfig(), ORDER_KEYS["fcfs"])
    w.clock_x = x
    r = SimRequest(idx=0, request_id="r0", arrival=0.0, input_len=100, output_len=5)
    w.enqueue(r, 0.0)
    end = w.start_step(0.0)
    assert end * 1000.0 == pytest.approx(ttft_ms)
    w.end_step(end)
    end2 = w.start_step(end)
    assert (end2 - end) * 1000.0 == pytest.approx(step_ms)
    assert w.step.base_decode_ms == pytest.approx(7.0)  # the same work at the maximum clock


@pytest.mark.parametrize("tp", [1, 2])
def test_energy_is_idle_power_over_uptime_plus_busy_power_over_steps(tp):
    # two lone requests: each 110 ms prefill + 4 decode steps of 7 ms = 138 ms busy; horizon 1.138 s
    tr = from_requests([(0.0, 100, 5), (1.0, 100, 5)])
    res = simulate(tr, PERF, SimConfig(worker=WorkerConfig(tp=tp), power_bin_s=0.25))
    x = res.extra
    assert res.horizon_s == pytest.approx(1.138)
    # by hand: H100 TDP 700 W, idle 10% = 70 W, busy at max clock 700 W
    expect = tp * (70.0 * 1.138 + (700.0 - 70.0) * 0.276)
    assert x["energy_j"] == pytest.approx(expect)
    assert x["avg_power_w"] == pytest.approx(expect / 1.138)
    assert x["util"] == pytest.approx(0.276 / 1.138)
    # the power series integrates to the same energy (∫ P dt over its bins)
    widths = np.diff(np.append(x["power_t"], res.horizon_s))
    assert float(np.dot(x["power_w"], widths)) == pytest.approx(expect)
    m = report.metrics(res)
    assert m["j_per_request"] == pytest.approx(expect / 2) and m["j_per_token"] == pytest.approx(expect / 10)


def test_energy_at_a_lower_clock_uses_the_power_model():
    from polyserve.simulator.power import PowerMeter

    meter = PowerMeter(H100, tp=4, bin_s=1.0)
    meter.step(0.5, 2.0, 990)  # busy 2 s at half the maximum clock
    x = meter.finish([(0.0, 4.0)], 4.0)
    busy_w = 700.0 * 0.9 * 0.5 ** gpu_model.GAMMA  # P(1, x) − P(0) per GPU
    assert x["energy_j"] == pytest.approx(4 * (70.0 * 4.0 + busy_w * 2.0))
    assert x["energy_j"] == pytest.approx(sum(x["power_w"]) * 1.0)  # 1 s bins
    assert x["power_per_gpu_w"] == pytest.approx(x["energy_j"] / 16.0)


def test_miad_lowers_power_at_a_light_load_and_keeps_the_slos():
    tr = from_requests(_poisson(2.0, 120.0, 50, 40))
    runs = {c: simulate(tr, PERF, SimConfig(workers=2, clock=c)) for c in ("max", "miad")}
    m = {c: report.metrics(r) for c, r in runs.items()}
    assert m["max"]["slo_both"] >= 0.99 and m["miad"]["slo_both"] >= 0.99
    assert m["miad"]["avg_power_w"] < 0.8 * m["max"]["avg_power_w"]
    x = runs["miad"].extra
    assert len(x["clock_t"]) > 100 and min(x["clock_min_mhz"]) < H100.max_mhz
    assert x["clock_avg_mhz"] < H100.max_mhz and x["miad_decisions"]["down"] > 0
    assert set(runs["max"].extra["clock_mean_mhz"]) == {H100.max_mhz}  # pinned
    # ∫ power = energy for the MIAD run too
    widths = np.diff(np.append(x["power_t"], runs["miad"].horizon_s))
    assert float(np.dot(x["power_w"], widths)) == pytest.approx(x["energy_j"])


def test_miad_raises_the_clock_when_the_load_rises():
    light = _poisson(1.0, 60.0, 50, 40)
    heavy = [(60.0 + t, 400, 40) for t, _, _ in _poisson(25.0, 30.0, 0, 0, seed=1)]
    res = simulate(from_requests(light + heavy), PERF, SimConfig(workers=1, clock="miad"))
    t, f = np.array(res.extra["clock_t"]), np.array(res.extra["clock_mean_mhz"])
    assert f[(t > 40) & (t < 60)].mean() < f[(t > 65) & (t < 90)].mean()
    assert res.extra["miad_decisions"]["up"] > 0


def test_bad_clock_settings_say_what_to_fix():
    with pytest.raises(ValueError, match="clock 'turbo' is unknown"):
        SimConfig(clock="turbo").validate()
    with pytest.raises(ValueError, match="gpu 'tpu' is unknown"):
        SimConfig(gpu="tpu").validate()


def test_cli_clock_sweep_reports_energy_and_plots_the_clock(tmp_path: Path):
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for k, (t, i, o) in enumerate(_poisson(0.3, 200.0, 300, 60)):
        rows.append(f"2023-11-16 18:{int(t // 60):02d}:{t % 60:010.7f},{i + k % 7},{o}")
    csv = tmp_path / "t.csv"
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    rc = cli_main(["--trace", str(csv), "--workers", "1", "--clock", "max,miad", "--miad-min-mhz", "0,900",
                   "--slo-scale", "1,2", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    labels = [r["label"] for r in data["rows"]]
    assert len(labels) == 6 and any(">=900MHz" in lab for lab in labels)
    for r in data["rows"]:
        assert r["energy_j"] > 0 and r["j_per_token"] > 0 and r["clock"] in ("max", "miad")
    assert data["rows"][-1]["ttft_slo_ms"] == pytest.approx(3200.0)  # SLO scale 2
    assert (out / "clock_t_x1.png").exists() and (out / "clock_t_x1_slo2.png").exists()
    text = (out / "results.txt").read_text()
    assert "J/token" in text and "MIAD vs the maximum clock at equal SLO attainment" in text
    assert cli_main(["--trace", str(csv), "--clock", "turbo", "--out", str(out)]) == 2


def test_miad_table_compares_at_equal_attainment():
    def row(clock, floor, slo, watts, jpt):
        return {"trace": "t", "load": 1.0, "slo_scale": 1.0, "group": "g", "clock": clock, "miad_min_mhz": floor,
                "slo_both": slo, "avg_power_w": watts, "j_per_token": jpt}

    rows = [row("max", 0, 0.999, 1000.0, 10.0), row("miad", 0, 0.95, 300.0, 3.0),  # cheapest, misses the target
            row("miad", 900, 0.991, 500.0, 5.0), row("miad", 1200, 0.999, 700.0, 7.0)]
    line = report.miad_table(rows, 0.99).splitlines()[-1]
    assert "900" in line and "2.00x" in line and "0.950 / 300" in line
    rows[0]["slo_both"] = 0.98  # the max clock misses the target itself: no comparison
    assert "none" in report.miad_table(rows, 0.99).splitlines()[-1]
