"""Energy accounting (gpu_agent.energy): a simulated GPU of known power -> joules per window,
J/request and J/output token by hand; the token split rule; the source label."""
import pytest

from polyserve.gpu_agent.energy import Done, EnergyMeter, energy_source, split_energy
from polyserve.gpu_agent.gpu import NvmlGpu, SimulatedGpu
from polyserve.gpu_agent.gpu_model import GAMMA
from polyserve.proto import Completed
from tests.unit.test_gpu import Clock, fake_nvml

pytestmark = pytest.mark.unit


def completed(worker, inp, out):
    return Completed(request_id=f"r-{worker}-{inp}-{out}", worker_id=worker, input_tokens=inp, output_tokens=out,
                     e2e_ms=10.0, ttft_ms=1.0)


def test_windows_match_a_hand_computation_on_a_simulated_gpu():
    clock = Clock()
    gpu = SimulatedGpu(clock=clock)  # idle 60 W, max 300 W, 1410 MHz
    meter = EnergyMeter("sim0")
    assert meter.observe(gpu.read(), now=0.0, source="model") is None  # opens the first window
    gpu.set_load(active_requests=2, workers=2)  # u = 2 / (2 + 2) = 0.5 -> 60 + 240 * 0.5 = 180 W
    for w, i, o in (("w1", 100, 50), ("w1", 50, 25), ("w2", 0, 75)):
        meter.add(completed(w, i, o))
    clock.t = 2.0
    rep = meter.observe(gpu.read(), now=2.0, source="model")
    assert rep.energy_j == pytest.approx(360.0)  # 180 W x 2 s
    assert (rep.requests, rep.tokens, rep.output_tokens, rep.window_s) == (3, 300, 150, 2.0)
    assert rep.j_per_request == pytest.approx(120.0) and rep.j_per_token == pytest.approx(2.4)
    assert rep.per_worker_j == pytest.approx({"w1": 360.0 * 225 / 300, "w2": 360.0 * 75 / 300})
    assert rep.source == "model" and rep.simulated is True

    gpu.set_sm_clock_limit(705)  # half the clock: P = 60 + 240 * 0.5 * 0.5^GAMMA
    meter.add(completed("w2", 10, 10))
    clock.t = 3.0
    rep2 = meter.observe(gpu.read(), now=3.0, source="model")
    p_half = 60.0 + 240.0 * 0.5 * 0.5 ** GAMMA
    assert rep2.energy_j == pytest.approx(p_half, abs=2e-3)  # readings are rounded to mJ
    assert rep2.j_per_token == pytest.approx(p_half / 10, abs=1e-3) and rep2.per_worker_j.keys() == {"w2"}

    clock.t = 4.0  # nothing completed: the energy is reported, no per-request figure
    rep3 = meter.observe(gpu.read(), now=4.0, source="model")
    assert rep3.requests == 0 and rep3.j_per_request is None and rep3.j_per_token is None and rep3.energy_j > 0
    total = meter.total
    assert total.energy_j == pytest.approx(360.0 + rep2.energy_j + rep3.energy_j, abs=1e-3)
    assert (total.requests, total.output_tokens, total.window_s) == (4, 160, 4.0)
    assert total.j_per_token == pytest.approx(total.energy_j / 160)


def test_counter_going_backwards_reopens_the_window():
    meter = EnergyMeter("g")
    clock = Clock()
    gpu = SimulatedGpu(clock=clock)
    clock.t = 5.0
    meter.observe(gpu.read(), 5.0, "model")
    fresh = SimulatedGpu(clock=clock)  # e.g. driver reload: the counter restarts near zero
    assert meter.observe(fresh.read(), 6.0, "model") is None


def test_token_split_rule():
    parts = split_energy(90.0, [Done("a", 10, 20), Done("b", 0, 0), Done("a", 0, 59)])
    assert parts == pytest.approx({"a": 90.0 * 89 / 90, "b": 90.0 * 1 / 90})  # a token-less request weighs 1
    assert split_energy(5.0, []) == {}


def test_source_label():
    sim = SimulatedGpu()
    assert energy_source(sim, sim.read()) == "model"
    with_counter = NvmlGpu(fake_nvml(), 0)
    assert energy_source(with_counter, with_counter.read()) == "nvml"
    without = NvmlGpu(fake_nvml(energy=False), 0)
    assert energy_source(without, without.read()) == "nvml_power"
