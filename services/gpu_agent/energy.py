"""Energy accounting of one GPU: joules per window, split over the requests its workers completed.

Every telemetry interval the agent reads its GPU once; the window's energy is the
difference of the GPU's cumulative energy between two readings:

* source "nvml": the GPU's total-energy counter (nvmlDeviceGetTotalEnergyConsumption,
  Volta and later) — measured;
* source "nvml_power": a real GPU without that counter: NVML power samples
  integrated over time (`gpu.NvmlGpu`) — measured power, coarse in time;
* source "model": the simulated GPU, whose power follows its documented load/clock
  curve (`gpu.SimulatedGpu`, exponent from `gpu_model`) integrated exactly between
  load changes — estimated, and `simulated` is true.

Attribution rule: ALL of the window's energy (idle draw included) goes to the
requests that completed on this GPU's workers during the window (`completed`
events whose worker the agent runs), each in proportion to its tokens
(input + output): a request of t tokens gets E·t / Σt. `j_per_request` = E / requests,
`j_per_token` = E / output tokens (None when no request, or no output token: encoder
requests), `per_worker_j` = the sum over each worker's requests. A window in which
nothing completed is reported with requests = 0 and no per-request figures; its
energy is not carried into the next window.

Besides the per-window `EnergyReport` (published on `Subjects.gpu_energy`), the agent
keeps a running total since it started (same rule, window_s = time since start).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from polyserve.gpu_agent.gpu import GpuReading
from polyserve.proto import Completed, EnergyReport


@dataclass(frozen=True)
class Done:
    worker_id: str
    input_tokens: int
    output_tokens: int


def split_energy(energy_j: float, done: list[Done]) -> dict[str, float]:
    """Per worker joules by the token rule (module docstring); {} with no request.
    Requests with no token at all count as one token each, so none is free."""
    weights = [max(1, d.input_tokens + d.output_tokens) for d in done]
    total = sum(weights)
    out: dict[str, float] = defaultdict(float)
    for d, w in zip(done, weights):
        out[d.worker_id] += energy_j * w / total
    return dict(out)


def report(gpu_id: str, window_s: float, energy_j: float, source: str, simulated: bool,
           done: list[Done], ts: float) -> EnergyReport:
    """The EnergyReport of one window (or of the running total)."""
    requests = len(done)
    out_tok = sum(d.output_tokens for d in done)
    tokens = sum(d.input_tokens + d.output_tokens for d in done)
    return EnergyReport(
        ts=ts, gpu_id=gpu_id, window_s=round(window_s, 6), energy_j=round(energy_j, 6), source=source,
        simulated=simulated, requests=requests, tokens=tokens, output_tokens=out_tok,
        j_per_request=round(energy_j / requests, 6) if requests else None,
        j_per_token=round(energy_j / out_tok, 6) if out_tok else None,
        per_worker_j={w: round(j, 6) for w, j in split_energy(energy_j, done).items()})


def energy_source(gpu: object, reading: GpuReading) -> str:
    if reading.simulated:
        return "model"
    return "nvml" if getattr(gpu, "energy_counter", True) else "nvml_power"


@dataclass
class EnergyMeter:
    """Windows of one agent's GPU. `observe` is fed one reading per telemetry interval."""

    gpu_id: str
    done: list[Done] = field(default_factory=list)  # completions of the open window
    start_t: float | None = None  # wall clock of the first reading
    last_t: float | None = None
    last_j: float | None = None
    total_j: float = 0.0
    total_requests: int = 0
    total_tokens: int = 0
    total_output: int = 0
    latest: EnergyReport | None = None
    total: EnergyReport | None = None

    def add(self, ev: Completed) -> None:
        self.done.append(Done(ev.worker_id, max(0, ev.input_tokens), max(0, ev.output_tokens)))

    def observe(self, reading: GpuReading, now: float, source: str) -> EnergyReport | None:
        """Close the window at `reading` (taken at wall-clock `now`); None for the first
        reading (it opens the first window) or after the counter went backwards."""
        done, self.done = self.done, []
        if self.last_j is None or self.last_t is None or reading.energy_j < self.last_j:
            self.last_j, self.last_t = reading.energy_j, now
            if self.start_t is None:
                self.start_t = now
            return None
        energy = reading.energy_j - self.last_j
        window = now - self.last_t
        self.last_j, self.last_t = reading.energy_j, now
        self.latest = report(self.gpu_id, window, energy, source, reading.simulated, done, now)
        self.total_j += energy
        self.total_requests += len(done)
        self.total_tokens += sum(d.input_tokens + d.output_tokens for d in done)
        self.total_output += sum(d.output_tokens for d in done)
        assert self.start_t is not None
        req, out = self.total_requests, self.total_output
        self.total = EnergyReport(
            ts=now, gpu_id=self.gpu_id, window_s=round(now - self.start_t, 6), energy_j=round(self.total_j, 6),
            source=source, simulated=reading.simulated, requests=req, tokens=self.total_tokens,
            output_tokens=out, j_per_request=round(self.total_j / req, 6) if req else None,
            j_per_token=round(self.total_j / out, 6) if out else None)
        return self.latest
