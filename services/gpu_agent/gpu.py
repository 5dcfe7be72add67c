"""GPU readings: NVML (read only) when a GPU is present, else a labelled simulation.

`NvmlGpu` reads power, the total-energy counter, SM/memory clocks, the maximum
SM clock, utilisation and memory through `pynvml` (the `nvidia-ml-py`
package). It never sets clocks or power limits: a GPU's clocks are changed only
where the operator allowed it (DESIGN.md, rules), and that is not this module.

`SimulatedGpu` produces plausible readings from documented curves and is
always labelled `simulated=True`. Its SM clock limit may be set, because it
changes nothing real; the MIAD controller is tested against it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from polyserve.gpu_agent.gpu_model import GAMMA

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """One sample of a GPU's state; `simulated` says whether it came from hardware."""

    name: str
    simulated: bool
    power_w: float
    energy_j: float
    sm_clock_mhz: int
    mem_clock_mhz: int
    max_sm_clock_mhz: int
    util_gpu_pct: float
    util_mem_pct: float
    mem_used_mb: float
    mem_total_mb: float


class Gpu(Protocol):
    """What the agent needs from a GPU: a name, a label and readings."""

    simulated: bool
    name: str
    uuid: str

    def read(self) -> GpuReading: ...

    def set_load(self, active_requests: int, workers: int) -> None: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- NVML
class NvmlGpu:
    """Readings of one physical GPU through NVML. READ ONLY: no setter exists here.

    Readings that a GPU does not support (e.g. the energy counter before Volta)
    fall back: energy is then integrated from power samples, other fields read 0.
    """

    simulated = False

    def __init__(self, nvml: Any, index: int, clock: Callable[[], float] = time.monotonic):
        self._nvml = nvml
        self.index = index
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.name = _text(nvml.nvmlDeviceGetName(self._handle))
        self.uuid = _text(self._try(nvml.nvmlDeviceGetUUID, ""))
        self._clock = clock
        self._energy_supported = True
        self._integrated_j = 0.0
        self._last_t: float | None = None
        self._max_sm = int(self._try(lambda h: nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM), 0))
        # NVML handles are not documented as thread safe; reads may run in a worker thread.
        self._lock = threading.Lock()

    def _try(self, fn: Callable[[Any], Any], default: Any) -> Any:
        try:
            return fn(self._handle)
        except self._nvml.NVMLError as exc:
            logger.debug("NVML %s not available: %s", getattr(fn, "__name__", fn), exc)
            return default

    def read(self) -> GpuReading:
        """Sample the device (blocking; call it from a thread in async code)."""
        nvml = self._nvml
        with self._lock:
            power_w = self._try(nvml.nvmlDeviceGetPowerUsage, 0) / 1000.0  # mW -> W
            now = self._clock()
            if self._last_t is not None:
                self._integrated_j += power_w * max(0.0, now - self._last_t)
            self._last_t = now
            energy_j = self._integrated_j
            if self._energy_supported:
                try:  # mJ since the driver was loaded (Volta and later)
                    energy_j = nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0
                except nvml.NVMLError:
                    self._energy_supported = False
                    logger.info("GPU %d has no energy counter; integrating power instead", self.index)
            util = self._try(nvml.nvmlDeviceGetUtilizationRates, None)
            mem = self._try(nvml.nvmlDeviceGetMemoryInfo, None)
            return GpuReading(
                name=self.name,
                simulated=False,
                power_w=power_w,
                energy_j=energy_j,
                sm_clock_mhz=int(self._try(lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), 0)),
                mem_clock_mhz=int(self._try(lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM), 0)),
                max_sm_clock_mhz=self._max_sm,
                util_gpu_pct=float(util.gpu) if util is not None else 0.0,
                util_mem_pct=float(util.memory) if util is not None else 0.0,
                mem_used_mb=mem.used / 2**20 if mem is not None else 0.0,
                mem_total_mb=mem.total / 2**20 if mem is not None else 0.0,
            )

    @property
    def energy_counter(self) -> bool:
        """True while energy readings come from the GPU's own counter (not integrated power)."""
        return self._energy_supported

    def set_load(self, active_requests: int, workers: int) -> None:
        """Real hardware reports its own load; nothing to do."""

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down; nothing to recover
            pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class SimSpec:
    """Constants of the simulated GPU (roughly an A100-40GB; labelled simulated everywhere)."""

    name: str = "Simulated GPU (A100-40GB-like)"
    idle_power_w: float = 60.0
    max_power_w: float = 300.0
    idle_sm_clock_mhz: int = 210
    max_sm_clock_mhz: int = 1410
    mem_clock_mhz: int = 1215
    mem_total_mb: float = 40960.0
    base_mem_mb: float = 500.0
    worker_mem_mb: float = 16384.0
    half_util_requests: float = 2.0
    clock_power_exponent: float = GAMMA  # gpu_model: calibrated from the Splitwise power cap


class SimulatedGpu:
    """A GPU whose readings follow documented curves; always `simulated=True`.

    With `a` active requests over all workers and `f` the SM clock (the clock
    limit when busy, the idle clock when no request runs):

    * utilisation `u = a / (a + k)` with `k = half_util_requests` (saturating:
      1 request -> 33 %, 8 requests -> 80 %);
    * power `P = P_idle + (P_max - P_idle) * u * (f / f_max)^γ`: rising with load
      and close to linearly with clock, as µ-Serve measured (§2.2, Fig. 2), with
      γ = `gpu_model.GAMMA` (1.55) calibrated in `gpu_model` from the Splitwise
      power-capped runs;
    * energy: `P` integrated over time between readings (joules);
    * memory used: `base + workers * worker_mem` capped at the total;
      memory utilisation `0.6 * u`.
    """

    simulated = True
    uuid = ""

    def __init__(self, spec: SimSpec | None = None, clock: Callable[[], float] = time.monotonic):
        self.spec = spec or SimSpec()
        self.name = self.spec.name
        self._clock = clock
        self._active = 0
        self._workers = 0
        self._clock_limit = self.spec.max_sm_clock_mhz
        self._energy_j = 0.0
        self._last_t = clock()

    def set_load(self, active_requests: int, workers: int) -> None:
        """Tell the simulation how busy its workers are (from their heartbeats)."""
        self._integrate()
        self._active = max(0, int(active_requests))
        self._workers = max(0, int(workers))

    def set_sm_clock_limit(self, mhz: int) -> None:
        """Cap the simulated SM clock (simulation only; nothing real changes)."""
        self._integrate()
        self._clock_limit = min(self.spec.max_sm_clock_mhz, max(self.spec.idle_sm_clock_mhz, int(mhz)))

    @property
    def clock_limit_mhz(self) -> int:
        """The SM clock cap in force (what MIAD set, or the maximum)."""
        return self._clock_limit

    def utilisation(self) -> float:
        """Fraction of time busy, 0..1."""
        a = self._active
        return a / (a + self.spec.half_util_requests) if a > 0 else 0.0

    def sm_clock(self) -> int:
        return self._clock_limit if self._active > 0 else self.spec.idle_sm_clock_mhz

    def power(self) -> float:
        """Watts for the current load and clock (see the class docstring)."""
        s = self.spec
        return s.idle_power_w + (s.max_power_w - s.idle_power_w) * self.utilisation() * (
            self.sm_clock() / s.max_sm_clock_mhz) ** s.clock_power_exponent

    def _integrate(self) -> None:
        """Add the energy used since the last call; every state change calls this first,
        so the current power held for the whole interval."""
        now = self._clock()
        self._energy_j += self.power() * max(0.0, now - self._last_t)
        self._last_t = now

    def read(self) -> GpuReading:
        self._integrate()
        s = self.spec
        u = self.utilisation()
        return GpuReading(
            name=s.name,
            simulated=True,
            power_w=round(self.power(), 3),
            energy_j=round(self._energy_j, 3),
            sm_clock_mhz=self.sm_clock(),
            mem_clock_mhz=s.mem_clock_mhz,
            max_sm_clock_mhz=s.max_sm_clock_mhz,
            util_gpu_pct=round(100.0 * u, 2),
            util_mem_pct=round(60.0 * u, 2),
            mem_used_mb=min(s.mem_total_mb, s.base_mem_mb + self._workers * s.worker_mem_mb),
            mem_total_mb=s.mem_total_mb,
        )

    def close(self) -> None:
        """Nothing to release."""


def detect_gpu(index: int = 0, force_simulated: bool = False, nvml: Any = None) -> Gpu:
    """NvmlGpu for device `index` when NVML initialises and has it, else SimulatedGpu.

    `nvml` lets tests pass a stand-in for the `pynvml` module.
    """
    if force_simulated:
        logger.info("GPU simulation forced by settings")
        return SimulatedGpu()
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: PLW0127 - imported here: no I/O at import time
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, driver errors
        logger.info("NVML unavailable (%s); using a simulated GPU", exc)
        return SimulatedGpu()
    try:
        count = nvml.nvmlDeviceGetCount()
        if index >= count or index < 0:
            logger.warning("NVML has %d device(s), none with index %d; using a simulated GPU", count, index)
            nvml.nvmlShutdown()
            return SimulatedGpu()
        gpu = NvmlGpu(nvml, index)
    except Exception as exc:  # noqa: BLE001
        logger.warning("NVML device %d unreadable (%s); using a simulated GPU", index, exc)
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return SimulatedGpu()
    logger.info("GPU %d: %s (NVML, read only)", index, gpu.name)
    return gpu

