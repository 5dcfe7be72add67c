"""µ-Serve MIAD (Alg. 3), the simulated GPU's clock curves, the sensitivity score
and the rule that nothing but a SimulatedGpu is touched in tests."""
import math
import types
from pathlib import Path

import pytest

from polyserve.gpu_agent import gpu_model as gm
from polyserve.gpu_agent import miad
from polyserve.gpu_agent.clock_control import NvmlLockedClocks, SimulatedClock, choose_actuator
from polyserve.gpu_agent.gpu import SimulatedGpu
from polyserve.gpu_agent.miad import DOWN, SAME, UP, MiadConfig, MiadState, PartitionObs

pytestmark = pytest.mark.unit
SPLITWISE = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "profiles" / \
    "splitwise_llama2_70b_bloom_176b_a100_h100.csv"
CFG = MiadConfig(min_mhz=210, max_mhz=1410, step_mhz=100)


def obs(actual, target=100.0, weight=1.0, name="w"):
    return PartitionObs(name, target, actual, weight)


def test_starts_at_max_and_doubles_on_small_slack_capped_at_max():
    st = miad.initial_state(CFG)
    assert st.freq_mhz == 1410
    st = MiadState(300)
    st, d = miad.miad_step(st, [obs(96.0)], CFG)  # slack 0.04 < 0.05
    assert (d.action, d.freq_mhz, d.previous_mhz, d.missing) == (UP, 600, 300, ("w",))
    st, d = miad.miad_step(st, [obs(120.0)], CFG)  # negative slack
    assert d.freq_mhz == 1200
    st, d = miad.miad_step(st, [obs(120.0)], CFG)
    assert d.freq_mhz == 1410  # capped at MAX


def test_lowers_by_step_when_the_degradation_fits_in_the_slack():
    # slack 0.5; degradation of one step = 1.0·50·100/1410 = 3.5 ms -> 0.035 < 0.45
    _, d = miad.miad_step(MiadState(1410), [obs(50.0)], CFG)
    assert (d.action, d.freq_mhz) == (DOWN, 1310)
    # slack 0.1; at 300 MHz one step costs 90·100/300 = 30 ms -> 0.30 > 0.05: stay
    _, d = miad.miad_step(MiadState(300), [obs(90.0)], CFG)
    assert (d.action, d.freq_mhz) == (SAME, 300)
    # an insensitive worker (weight 0.1) may step down where a sensitive one may not
    _, d = miad.miad_step(MiadState(300), [obs(90.0, weight=0.1)], CFG)
    assert d.action == DOWN


def test_never_beyond_min_or_max():
    st = MiadState(250)
    for _ in range(5):
        st, d = miad.miad_step(st, [obs(1.0)], CFG)
        assert CFG.min_mhz <= d.freq_mhz <= CFG.max_mhz
    assert st.freq_mhz == 210
    for _ in range(6):
        st, d = miad.miad_step(st, [obs(500.0)], CFG)
        assert CFG.min_mhz <= d.freq_mhz <= CFG.max_mhz
    assert st.freq_mhz == 1410
    assert miad.initial_state(MiadConfig(min_mhz=210, max_mhz=1410, default_mhz=5000)).freq_mhz == 1410


def test_one_worker_missing_wins_and_down_needs_every_worker_by_default():
    fine, tight, late = obs(20.0, name="a"), obs(90.0, name="b"), obs(99.0, name="c")
    _, d = miad.miad_step(MiadState(1000), [fine, late], CFG)
    assert d.action == UP and d.missing == ("c",)
    _, d = miad.miad_step(MiadState(1000), [fine, tight], CFG)
    assert d.action == SAME  # b cannot afford the step: the most sensitive bounds the GPU
    literal = MiadConfig(min_mhz=210, max_mhz=1410, down_requires_all=False)
    _, d = miad.miad_step(MiadState(1000), [fine, tight], literal)
    assert d.action == DOWN  # Alg. 3 as printed: any worker with room
    _, d = miad.miad_step(MiadState(1000), [obs(None), obs(None)], CFG)
    assert d.action == SAME and "no latency sample" in d.reason


def test_scale_out_signal_after_repeated_up_at_max():
    cfg = MiadConfig(min_mhz=210, max_mhz=1410, scale_out_after=3)
    st, signals = MiadState(705), []
    for _ in range(5):
        st, d = miad.miad_step(st, [obs(150.0)], cfg)
        signals.append(d.scale_out)
    assert signals == [False, False, False, True, True]  # 705 -> 1410, then 3 UPs at max
    st, d = miad.miad_step(st, [obs(10.0)], cfg)
    assert not d.scale_out and st.up_at_max == 0


def test_closed_loop_on_the_simulated_gpu_settles_under_the_slo():
    gpu = SimulatedGpu(clock=lambda: 0.0)
    act = choose_actuator(gpu, allow_clock_control=True, min_mhz=210)
    assert isinstance(act, SimulatedClock)
    work = gm.llm_request(prefill_ms=60.0, decode_ms=40.0, knee=0.5)  # 100 ms at max clock
    cfg = MiadConfig(min_mhz=210, max_mhz=gpu.spec.max_sm_clock_mhz, step_mhz=50)
    st = miad.initial_state(cfg)
    gpu.set_load(4, 1)
    p_max = gpu.power()
    for _ in range(60):
        x = st.freq_mhz / cfg.max_mhz
        st, d = miad.miad_step(st, [obs(work.at(x), target=150.0, weight=work.elasticity(x))], cfg)
        act.apply(d.freq_mhz)
    lat = work.at(st.freq_mhz / cfg.max_mhz)
    assert lat <= 150.0 * 0.95 and d.action == SAME  # settled with slack >= 0.05 (860 MHz here)
    assert st.freq_mhz < cfg.max_mhz and gpu.read().simulated is True
    assert gpu.read().sm_clock_mhz == st.freq_mhz and gpu.power() < p_max  # lower clock, less power


def test_no_actuator_without_permission_and_nvml_only_with_it():
    gpu = SimulatedGpu()
    assert choose_actuator(gpu, allow_clock_control=False, min_mhz=210) is None
    calls = []
    fake_nvml = types.SimpleNamespace(
        NVML_CLOCK_MEM=2,
        nvmlDeviceGetClockInfo=lambda h, k: 2619,
        nvmlDeviceGetSupportedGraphicsClocks=lambda h, mem: [1980, 1410, 1005, 210],
        nvmlDeviceSetGpuLockedClocks=lambda h, lo, hi: calls.append(("lock", lo, hi)),
        nvmlDeviceResetGpuLockedClocks=lambda h: calls.append(("reset",)))
    real = types.SimpleNamespace(simulated=False, name="fake", _nvml=fake_nvml, _handle=object())
    assert choose_actuator(real, allow_clock_control=False, min_mhz=210) is None
    act = choose_actuator(real, allow_clock_control=True, min_mhz=210)  # a stand-in module, no driver
    assert isinstance(act, NvmlLockedClocks)
    assert act.apply(1300) == 1005  # rounded down to a supported clock
    act.close()
    assert calls == [("lock", 210, 1005), ("reset",)]


# --------------------------------------------------------------------------- GPU model
def test_latency_curve_has_fig2_shape():
    w = gm.WorkLatency(compute_ms=50.0, memory_ms=50.0, knee=0.3)
    xs = [0.15, 0.3, 0.5, 0.8, 1.0]
    lat = [w.at(x) for x in xs]
    assert lat == sorted(lat, reverse=True)  # falls with the clock
    assert lat[0] - lat[1] > lat[3] - lat[4]  # steep at low clocks, flat toward the top
    assert w.at(1.0) == pytest.approx(100.0)
    assert w.elasticity(1.0) == pytest.approx(0.5) and w.elasticity(0.2) == pytest.approx(1.0)
    assert gm.WorkLatency(compute_ms=10.0).sensitivity_score() == pytest.approx(1.0)
    assert gm.WorkLatency(compute_ms=0.0, memory_ms=10.0).sensitivity_score() == pytest.approx(0.0)
    llm = gm.llm_request(prefill_ms=100.0, decode_ms=900.0)
    assert llm.at(1.0 / 1.3) == pytest.approx(100.0 * 1.3 + 900.0)  # prefill ×1.30, decode ×1.00 under the cap


def test_power_curve_is_calibrated():
    h100 = gm.H100_80GB
    assert gm.GAMMA == pytest.approx(1.545, abs=1e-3)
    assert gm.power_w(h100, 0.0, 1980) == pytest.approx(0.10 * 700)
    assert gm.power_w(h100, 1.0, 1980) == pytest.approx(700.0)
    assert gm.power_w(h100, 1.0, 1980 / 1.3) == pytest.approx(0.70 * 700)  # the Splitwise cap
    assert gm.clock_under_cap(0.70) == pytest.approx(1 / 1.3)
    assert gm.clock_under_cap(0.70, util=0.5) == 1.0  # a half-busy GPU does not reach the cap
    ps = [gm.power_w(h100, 0.8, f) for f in range(400, 2000, 200)]
    assert ps == sorted(ps)
    # µ-Serve §2.2's quoted pair: V100 gpt2-large 214 W at 1,300 MHz -> 120 W at 800 MHz
    v100 = gm.GpuClockSpec("V100", 300.0, 200, 1300)
    u = gm.util_from_power(214 / 300)
    assert gm.power_w(v100, u, 800) == pytest.approx(120.0, rel=0.05)
    assert gm.fit_gamma(700.0, 490.0, 1 / 1.3, 70.0) == pytest.approx(gm.GAMMA)


@pytest.mark.skipif(not SPLITWISE.is_file(), reason=f"{SPLITWISE} not present")
def test_calibration_figures_come_from_the_splitwise_csv():
    c = gm.calibrate_splitwise(SPLITWISE)
    assert c["pairs"] == 76
    assert c["prompt_slowdown_median"] == pytest.approx(gm.CAP_SLOWDOWN, abs=1e-3)
    assert c["token_slowdown_median"] == pytest.approx(1.0, abs=1e-3)
    assert c["gamma"] == pytest.approx(gm.GAMMA, abs=1e-3)
    assert c["a100_peak_power_median"] == pytest.approx(gm.PEAK, abs=0.05)


def test_simulated_gpu_is_labelled_and_follows_the_clock_limit():
    gpu = SimulatedGpu(clock=lambda: 0.0)
    gpu.set_load(8, 1)
    full = gpu.read()
    gpu.set_sm_clock_limit(705)
    half = gpu.read()
    assert full.simulated and half.simulated and half.sm_clock_mhz == 705
    s = gpu.spec
    busy = full.power_w - s.idle_power_w
    assert half.power_w - s.idle_power_w == pytest.approx(busy * 0.5 ** gm.GAMMA, rel=1e-3)


# --------------------------------------------------------------------------- sensitivity score (§3.1)
def test_placement_uses_a_real_sensitivity_score():
    prefill_heavy = gm.llm_request(prefill_ms=400.0, decode_ms=100.0).sensitivity_score()
    decode_heavy = gm.llm_request(prefill_ms=20.0, decode_ms=2000.0).sensitivity_score()
    assert prefill_heavy > 0.5 > decode_heavy >= 0 and math.isfinite(decode_heavy)
