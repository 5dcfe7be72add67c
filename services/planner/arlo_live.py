"""Arlo's Runtime Scheduler (§3.3/§4) for the live planner, pure: no I/O but reading a profile.

Every `arlo_period_s` (Arlo: 120 s) the planner calls `compute_plan` for each
deployment served by `encoder` workers (each worker hosts ONE static-length
runtime; its heartbeat's `max_input_len` is that runtime's max_length):

1. demand: the input lengths of the requests the deployment completed in the last
   period (`Completed.input_tokens`: one event per embedded input, special tokens
   included), binned to their ideal runtime (the shortest whose max_length fits),
   as requests per SLO period (`arlo_ilp.demand_per_slo`);
2. the allocation: `arlo_ilp.solve` with G = the deployment's current instances and
   the runtimes of its EncoderProfile (`polyserve profile --encoder`); among the
   allocations within `min_gain` of the optimal objective, the one that moves the
   fewest instances (`solve(prefer=current)`: under-loaded instances make many
   allocations tie, and re-loading an instance costs a restart);
3. the fewest instance re-loads from the current runtimes to that allocation
   (`arlo_ilp.replacement_plan`, least loaded instances first, in batches).

No plan moves anything when the period saw no request (an all-zero demand makes
every allocation optimal).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from polyserve.core import profiles
from polyserve.core.profiles import profile_path
from polyserve.planner import arlo_ilp
from polyserve.proto import EncoderProfile, RuntimePlan
from polyserve.proto import RuntimeProfile as RuntimeSpec

SHIPPED_PROFILE = profile_path(profiles.ENCODER_CPU)
ENCODER_ENGINE = "encoder"


@dataclass(frozen=True)
class Runtimes:
    """The static runtimes of one EncoderProfile, shortest first, in both shapes."""

    path: str
    slo_ms: float
    specs: tuple[RuntimeSpec, ...]
    ilp: tuple[arlo_ilp.RuntimeProfile, ...]

    @property
    def max_lens(self) -> list[int]:
        return [s.max_length for s in self.specs]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def load_runtimes(path: str | Path) -> Runtimes:
    """Read an EncoderProfile JSON; ValueError naming what to fix when it cannot be used."""
    p = Path(path)
    try:
        prof = msgspec.json.decode(p.read_bytes(), type=EncoderProfile)
    except OSError as exc:
        raise ValueError(f"cannot read the encoder profile {p}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ValueError(f"{p} is not an EncoderProfile (polyserve profile --encoder writes one): {exc}") from exc
    specs = sorted((r for r in prof.runtimes if r.shape == "static" and r.max_length > 0),
                   key=lambda r: r.max_length)
    if not specs:
        raise ValueError(f"{p} lists no static runtime; re-run `polyserve profile --encoder`")
    if len({s.max_length for s in specs}) != len(specs):
        raise ValueError(f"{p} lists two runtimes with the same max_length")
    if prof.slo_ms <= 0:
        raise ValueError(f"{p}: slo_ms must be > 0")
    return Runtimes(str(p), float(prof.slo_ms), tuple(specs), tuple(arlo_ilp.from_runtime_spec(s) for s in specs))


def instance_runtime(max_input_len: int, max_lens: Sequence[int]) -> int:
    """The runtime index of a worker that takes `max_input_len` tokens: the profile's
    runtime of that length, else the shortest that covers it (the last one if none)."""
    return arlo_ilp.ideal_runtime(max_input_len, max_lens)


def runtime_env(spec: RuntimeSpec, profile_path: str = "") -> dict[str, str]:
    """StartWorker.extra_env of a worker hosting runtime `spec` (worker settings
    `encoder_*`); `profile_path` makes it replay that profile (a simulated worker)."""
    env = {"POLYSERVE_WORKER_ENCODER_MAX_LENGTH": str(spec.max_length),
           "POLYSERVE_WORKER_ENCODER_BATCH": str(spec.batch_size),
           "POLYSERVE_WORKER_ENCODER_SHAPE": "static",
           "POLYSERVE_WORKER_ENCODER_CAPACITY": str(spec.capacity)}
    if spec.backend:
        env["POLYSERVE_WORKER_ENCODER_BACKEND"] = spec.backend
    if profile_path:
        env["POLYSERVE_WORKER_ENCODER_PROFILE"] = profile_path
    return env


def _by_name(counts: Sequence[int], names: Sequence[str]) -> dict[str, int]:
    return {n: int(c) for n, c in zip(names, counts)}


def compute_plan(deployment: str, current: Mapping[str, int], rt: Runtimes, lengths: Sequence[int],
                 period_s: float, load: Mapping[str, float] | None = None, min_gain: float = 0.05,
                 batch_size: int = 2, fewest_moves: bool = True) -> tuple[RuntimePlan, arlo_ilp.ReplacementPlan]:
    """One period's plan for `deployment` (module docstring). `current`: worker id ->
    runtime index; `lengths`: input tokens of the requests completed in the period.
    `fewest_moves=False` takes the solver's optimum as is (for comparison)."""
    names, G = rt.names, len(current)
    if G < 1:
        raise ValueError(f"deployment {deployment} has no encoder instance to plan")
    cur = [0] * len(names)
    for idx in current.values():
        cur[idx] += 1
    previous = _by_name(cur, names)
    per_bin = [0] * len(names)
    for n in lengths:
        per_bin[arlo_ilp.ideal_runtime(int(n), rt.max_lens)] += 1
    rates = {name: round(c / period_s, 6) for name, c in zip(names, per_bin)}
    keep = arlo_ilp.ReplacementPlan(())
    base = dict(deployment=deployment, gpus=G, previous=previous, rates=rates)
    if not lengths:
        return RuntimePlan(**base, counts=previous, reason=f"no request in the last {period_s:g}s; "
                                                           "keeping the current runtimes"), keep
    demand = arlo_ilp.demand_per_slo(lengths, period_s, rt.slo_ms / 1e3, rt.max_lens)
    alloc = (arlo_ilp.solve(G, demand, rt.ilp, prefer=cur, tolerance=min_gain) if fewest_moves
             else arlo_ilp.solve(G, demand, rt.ilp))
    solve_ms = round(alloc.solve_s * 1e3, 3)
    why = f"{len(lengths)} requests in {period_s:g}s; ILP {alloc.status}"
    if not alloc.capacity_ok:
        why += f"; {G} instance(s) cannot hold the demand at every runtime's SLO capacity (Eq. 3): scale out"
    optimum = alloc.optimum if alloc.optimum is not None else alloc.objective
    if tuple(cur) == alloc.counts:
        how = ("optimal" if alloc.objective <= optimum * (1 + 1e-6) + 1e-9
               else f"within {min_gain:.0%} of the optimum ({alloc.objective:.1f} vs {optimum:.1f})")
        return RuntimePlan(**base, counts=previous, objective=alloc.objective, solve_ms=solve_ms,
                           reason=f"{why}; the current runtimes are {how}: keeping them"), keep
    cur_obj = arlo_ilp.evaluate(cur, demand, rt.ilp)[0]
    steps = arlo_ilp.replacement_plan(current, alloc.counts, load, batch_size)
    return RuntimePlan(**base, counts=_by_name(alloc.counts, names), changes=steps.changes,
                       objective=alloc.objective, solve_ms=solve_ms,
                       reason=f"{why}; objective {cur_obj:.1f} -> {alloc.objective:.1f}"), steps
