"""Who applies a MIAD decision. Only the agent's `allow_clock_control` setting picks
an actuator that changes anything (DESIGN.md, rules: never on a lent or shared GPU).

* `SimulatedClock`: `SimulatedGpu.set_sm_clock_limit` — changes nothing real.
* `NvmlLockedClocks`: `nvmlDeviceSetGpuLockedClocks(handle, min, f)` on a real GPU,
  `nvmlDeviceResetGpuLockedClocks` on close. Needs root or the admin's permission.
  Never constructed unless the operator allowed clock control; no test runs it.
* `choose_actuator` returns None without permission: the agent then only publishes.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class ClockActuator(Protocol):
    simulated: bool

    def apply(self, mhz: int) -> int: ...

    def close(self) -> None: ...


class SimulatedClock:
    simulated = True

    def __init__(self, gpu: Any):
        self.gpu = gpu

    def apply(self, mhz: int) -> int:
        self.gpu.set_sm_clock_limit(mhz)
        return mhz

    def close(self) -> None:
        self.gpu.set_sm_clock_limit(self.gpu.spec.max_sm_clock_mhz)


class NvmlLockedClocks:
    """Locks the SM clock of one NVML device to [min_mhz, f]. Real hardware: operator only."""

    simulated = False

    def __init__(self, nvml: Any, handle: Any, min_mhz: int, supported: list[int] | None = None):
        self._nvml, self._handle, self.min_mhz = nvml, handle, min_mhz
        self.supported = sorted(supported or [])
        self._locked = False

    def nearest_supported(self, mhz: int) -> int:
        """The highest supported clock not above `mhz` (or the lowest one)."""
        below = [c for c in self.supported if c <= mhz]
        return below[-1] if below else (self.supported[0] if self.supported else mhz)

    def apply(self, mhz: int) -> int:
        f = self.nearest_supported(mhz)
        self._nvml.nvmlDeviceSetGpuLockedClocks(self._handle, min(self.min_mhz, f), f)
        self._locked = True
        return f

    def close(self) -> None:
        if self._locked:
            try:
                self._nvml.nvmlDeviceResetGpuLockedClocks(self._handle)
            except Exception as exc:  # noqa: BLE001 - shutting down; say so and go on
                logger.warning("could not reset locked clocks: %s", exc)


def choose_actuator(gpu: Any, allow_clock_control: bool, min_mhz: int) -> ClockActuator | None:
    """The actuator for `gpu`, or None (publish only) without the operator's permission."""
    if not allow_clock_control:
        return None
    if getattr(gpu, "simulated", False):
        return SimulatedClock(gpu)
    nvml, handle = getattr(gpu, "_nvml", None), getattr(gpu, "_handle", None)
    if nvml is None or handle is None:
        logger.warning("clock control allowed but %s exposes no NVML handle; publishing only", gpu)
        return None
    supported: list[int] = []
    try:
        mem = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)
        supported = [int(c) for c in nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, mem)]
    except Exception as exc:  # noqa: BLE001 - older drivers: use the requested figures as they are
        logger.info("supported clocks unavailable (%s); requesting raw values", exc)
    logger.warning("clock control ALLOWED on a real GPU (%s): MIAD will lock SM clocks", getattr(gpu, "name", "?"))
    return NvmlLockedClocks(nvml, handle, min_mhz, supported)
