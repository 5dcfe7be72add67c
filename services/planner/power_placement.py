"""µ-Serve's power-aware placement (§3.1–§3.2, Alg. 2), as a pure function.

A GPU's clock can only go as low as its most frequency-sensitive tenant allows, so
µ-Serve puts partitions (here: models, runtimes or workers) of similar sensitivity
on the same GPU. Each partition carries a sensitivity score (`gpu_model.WorkLatency
.sensitivity_score`: the normalised latency increase when the clock is halved) and
a memory demand.

Algorithm (Alg. 2, with its two open points made explicit):
1. Sort all partitions by sensitivity, most sensitive first (§3.2: "all model
   partitions are then sorted based on the estimated sensitivity scores").
2. For each, the feasible devices are those with enough free memory that either
   already host this model or still leave the model under its spread cap CT
   (`max_devices_per_model`: the most GPUs one model may span).
3. Score of a used device = −|s_p − s̄_d| where s̄_d is the weight-averaged
   sensitivity of its tenants (Alg. 2's "similarity"). The listing initialises
   bestScore to +∞ and keeps a device when `bestScore < score`, which never holds;
   we keep the device with the highest similarity. An empty device scores
   −`open_penalty`: a partition opens a new GPU only when no used GPU is within
   `open_penalty` of its sensitivity, so dissimilar partitions do not share and
   similar ones do not spread needlessly. Ties go to the device with less free
   memory (best fit), then by id.
4. A partition that fits nowhere is returned in `unplaced` (never dropped silently).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    model: str
    name: str
    sensitivity: float
    mem_gb: float
    weight: float = 1.0  # share in the device average (µ-Serve: operator count × tensor size)


@dataclass(frozen=True)
class Device:
    gpu_id: str
    mem_gb: float


@dataclass(frozen=True)
class PowerPlacement:
    bins: dict[str, tuple[Partition, ...]]
    unplaced: tuple[Partition, ...]

    def sensitivity(self, gpu_id: str) -> float:
        """Weighted mean sensitivity of a device's tenants (0 when empty)."""
        parts = self.bins.get(gpu_id, ())
        total = sum(p.weight for p in parts)
        return sum(p.sensitivity * p.weight for p in parts) / total if total > 0 else 0.0

    def spread(self, model: str) -> int:
        return sum(1 for parts in self.bins.values() if any(p.model == model for p in parts))


def place(partitions: Sequence[Partition], devices: Sequence[Device], max_devices_per_model: int = 0,
          open_penalty: float = 0.1) -> PowerPlacement:
    """Alg. 2 (module docstring). `max_devices_per_model` 0 = no cap."""
    bins: dict[str, list[Partition]] = {d.gpu_id: [] for d in devices}
    free = {d.gpu_id: d.mem_gb for d in devices}
    spread: dict[str, set[str]] = {}
    unplaced = []
    for p in sorted(partitions, key=lambda p: (-p.sensitivity, p.model, p.name)):
        used = spread.setdefault(p.model, set())
        best: tuple[float, float, str] | None = None
        for d in devices:
            g = d.gpu_id
            if free[g] < p.mem_gb:
                continue
            if max_devices_per_model and g not in used and len(used) >= max_devices_per_model:
                continue
            tenants = bins[g]
            if tenants:
                w = sum(t.weight for t in tenants)
                mean = sum(t.sensitivity * t.weight for t in tenants) / w if w > 0 else 0.0
                score = -abs(p.sensitivity - mean)
            else:
                score = -open_penalty
            key = (score, -free[g], g)
            if best is None or key[:2] > best[:2] or (key[:2] == best[:2] and g < best[2]):
                best = key
        if best is None:
            unplaced.append(p)
            continue
        g = best[2]
        bins[g].append(p)
        free[g] -= p.mem_gb
        used.add(g)
    return PowerPlacement({g: tuple(ps) for g, ps in bins.items()}, tuple(unplaced))
