"""GPU readings (simulated and NVML through a stand-in module) and the gpu-agent's pure policy."""
import types

import pytest

from polyserve.gpu_agent import policy
from polyserve.gpu_agent.gpu import NvmlGpu, SimulatedGpu, detect_gpu

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_simulated_gpu_is_labelled_and_plausible():
    clock = Clock()
    gpu = SimulatedGpu(clock=clock)
    idle = gpu.read()
    assert idle.simulated is True and "Simulated" in idle.name
    assert idle.power_w == pytest.approx(gpu.spec.idle_power_w)
    assert idle.util_gpu_pct == 0 and idle.sm_clock_mhz == gpu.spec.idle_sm_clock_mhz
    gpu.set_load(active_requests=2, workers=1)
    busy = gpu.read()
    assert busy.util_gpu_pct == pytest.approx(50.0)
    assert busy.sm_clock_mhz == busy.max_sm_clock_mhz == gpu.spec.max_sm_clock_mhz
    assert gpu.spec.idle_power_w < busy.power_w < gpu.spec.max_power_w
    assert 0 < busy.mem_used_mb <= busy.mem_total_mb
    gpu.set_load(active_requests=16, workers=1)
    heavy = gpu.read()
    assert heavy.power_w > busy.power_w and heavy.util_gpu_pct < 100
    gpu.set_sm_clock_limit(705)  # half the clock: power rises less than linearly with load
    slow = gpu.read()
    assert slow.sm_clock_mhz == 705 and slow.power_w < heavy.power_w
    gpu.set_sm_clock_limit(10)
    assert gpu.read().sm_clock_mhz == gpu.spec.idle_sm_clock_mhz  # clamped to the supported range


def test_simulated_energy_integrates_power():
    clock = Clock()
    gpu = SimulatedGpu(clock=clock)
    clock.t = 10.0
    e1 = gpu.read().energy_j
    assert e1 == pytest.approx(10.0 * gpu.spec.idle_power_w)
    gpu.set_load(4, 1)
    p = gpu.power()
    clock.t = 12.0
    assert gpu.read().energy_j == pytest.approx(e1 + 2.0 * p)


def fake_nvml(count=1, energy=True):
    """A stand-in for the pynvml module with the calls NvmlGpu makes (and no setters)."""
    class NVMLError(Exception):
        pass

    calls = []

    def rec(name, value):
        def fn(*args):
            calls.append(name)
            if isinstance(value, Exception):
                raise value
            return value
        return fn

    m = types.SimpleNamespace(
        NVMLError=NVMLError, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, calls=calls,
        nvmlInit=rec("init", None), nvmlShutdown=rec("shutdown", None),
        nvmlDeviceGetCount=rec("count", count), nvmlDeviceGetHandleByIndex=rec("handle", object()),
        nvmlDeviceGetName=rec("name", b"NVIDIA H100"), nvmlDeviceGetUUID=rec("uuid", "GPU-abc"),
        nvmlDeviceGetPowerUsage=rec("power", 123_456),
        nvmlDeviceGetTotalEnergyConsumption=rec("energy", 5_000_000 if energy else NVMLError("n/a")),
        nvmlDeviceGetUtilizationRates=rec("util", types.SimpleNamespace(gpu=40, memory=20)),
        nvmlDeviceGetMemoryInfo=rec("mem", types.SimpleNamespace(used=2 * 2**30, total=80 * 2**30)),
    )
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == 1 else 2619
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    return m


def test_nvml_gpu_reads_units_and_is_not_simulated():
    nvml = fake_nvml()
    gpu = detect_gpu(0, nvml=nvml)
    assert isinstance(gpu, NvmlGpu) and gpu.simulated is False and gpu.uuid == "GPU-abc"
    r = gpu.read()
    assert r.simulated is False and r.name == "NVIDIA H100"
    assert r.power_w == pytest.approx(123.456) and r.energy_j == pytest.approx(5000.0)
    assert (r.sm_clock_mhz, r.mem_clock_mhz, r.max_sm_clock_mhz) == (1980, 2619, 1980)
    assert (r.util_gpu_pct, r.util_mem_pct) == (40.0, 20.0)
    assert r.mem_used_mb == pytest.approx(2048) and r.mem_total_mb == pytest.approx(81920)
    assert not any(hasattr(gpu, n) for n in ("set_sm_clock_limit", "set_clocks", "set_power_limit"))


def test_nvml_without_energy_counter_integrates_power():
    clock = Clock()
    nvml = fake_nvml(energy=False)
    gpu = NvmlGpu(nvml, 0, clock=clock)
    assert gpu.read().energy_j == 0.0
    clock.t = 2.0
    assert gpu.read().energy_j == pytest.approx(2.0 * 123.456)


def test_detect_gpu_falls_back_to_simulation():
    assert detect_gpu(0, nvml=fake_nvml(count=0)).simulated is True
    assert detect_gpu(3, nvml=fake_nvml(count=1)).simulated is True
    assert detect_gpu(0, force_simulated=True, nvml=fake_nvml()).simulated is True
    broken = fake_nvml()
    broken.nvmlInit = lambda: (_ for _ in ()).throw(broken.NVMLError("Library Not Found"))
    assert detect_gpu(0, nvml=broken).simulated is True


def test_agent_ids_commands_and_env():
    assert policy.resolve_gpu_id("", 1, simulated=False) == "gpu1"
    assert policy.resolve_gpu_id("", 0, simulated=True) == "sim0"
    assert policy.resolve_gpu_id("a100x", 0, simulated=True) == "a100x"
    assert policy.worker_command("", "polyserve.worker", "/py") == ["/py", "-m", "polyserve.worker"]
    assert policy.worker_command("/py '/a b/w.py' --x", "m", "/py") == ["/py", "/a b/w.py", "--x"]
    env = policy.worker_env({"PATH": "/bin", "POLYSERVE_NATS_URL": "old"}, nats_url="nats://n", redis_url="r",
                            prefix="p", worker_id="w-1", deployment="d", model="m", engine="sim", gpu_id="sim0",
                            time_scale="0", extra={"X": "1", "POLYSERVE_WORKER_WORKER_ID": "evil"})
    assert env["PATH"] == "/bin" and env["X"] == "1" and env["POLYSERVE_NATS_URL"] == "nats://n"
    assert env["POLYSERVE_WORKER_WORKER_ID"] == "w-1" and env["POLYSERVE_WORKER_TIME_SCALE"] == "0"
    assert (env["POLYSERVE_WORKER_DEPLOYMENT"], env["POLYSERVE_WORKER_ENGINE"]) == ("d", "sim")
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_choose_victims():
    W = policy.WorkerView
    ws = [W("a", "d", 1.0), W("b", "d", 2.0), W("c", "d", 3.0), W("x", "other", 4.0), W("s", "d", 5.0, True)]
    assert policy.choose_victims(ws, "d", 1) == ["c"]                        # most recent, not stopping
    assert policy.choose_victims(ws, "d", 2, load={"c": 5, "b": 1}) == ["a", "b"]  # least busy first
    assert policy.choose_victims(ws, "d", 10) == ["c", "b", "a"]
    assert policy.choose_victims(ws, "d", 1, worker_id="a") == ["a"]
    assert policy.choose_victims(ws, "", 1, worker_id="x") == ["x"]
    assert policy.choose_victims(ws, "d", 1, worker_id="x") == []             # wrong deployment
    assert policy.choose_victims(ws, "d", 1, worker_id="s") == []             # already stopping


def test_exit_reason_names_code_and_signal():
    assert policy.exit_reason(3) == "worker process exited with code 3"
    assert policy.exit_reason(-9) == "worker process exited with code -9 (SIGKILL)"
