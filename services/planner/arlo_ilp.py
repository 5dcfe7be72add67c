"""Arlo's runtime allocation (§3.3, Eqs. 1–7) solved exactly as a MILP, and the
minimal instance-replacement plan (§4).

The problem (Arlo §3.3). G GPUs; I runtimes sorted by max length; Q_i the mean
number of requests of length bin i (requests whose ideal runtime is i) during one
SLO period; M_i the capacity of one instance of runtime i within the SLO (requests
per SLO period); L_i(b) its profiled mean latency at batch/load b. Choose integers
N_i minimising  Σ_i L_i(B_i)·C_i  (1) subject to
  Σ N_i = G (2);  N_i ≥ ⌊Q_i/M_i⌋ (3);
  R_i = max(R_{i-1} + Q_i − N_i·M_i, 0), R_0 = 0 (4)   — overflow demoted to runtime i+1;
  C_i = min(R_{i-1} + Q_i, N_i·M_i) for i < I, C_I = R_{I-1} + Q_I (5);
  B_i = C_i / N_i (6);  N_I ≥ 1 (7).

The cost model. L_i is a table at profiled loads b_1 < … < b_K; B_i is fractional,
so some interpolation is needed in any case. We interpolate the *per-instance
total latency* h_i(B) = B·L_i(B) linearly between (0, 0) and the profiled points
(b_k, b_k·L_i(b_k)), extending the last segment beyond b_K (overload of the last
runtime). At every profiled load this is the paper's L_i exactly; between them
L_i(B) = h_i(B)/B. When h_i is not convex (a profile whose latency falls with
load somewhere) it is replaced by its lower convex hull and the result says so
(`convexified`); `evaluate` (and so the brute-force check) uses the same h_i.

The exact linearisation. With h_i convex and piecewise linear,
h_i(B) = max_k (a_ik·B + β_ik) with β_ik ≤ 0 (since h_i(0) = 0), and the objective
term L_i(B_i)·C_i = N_i·h_i(C_i/N_i) is the *perspective* of h_i:
    N_i·h_i(C_i/N_i) = max_k (a_ik·C_i + β_ik·N_i),
which is linear in (C_i, N_i) inside the max, so an epigraph variable t_i with
t_i ≥ a_ik·C_i + β_ik·N_i (all k) and min Σ t_i is exact (no approximation, no
per-count variables). N_i = 0 forces C_i = 0 (i < I) and gives t_i = 0 as Eq. 6
intends. The max/min of Eqs. 4–5 are made exact with one binary z_i per runtime
(i < I) and big-M constants U_i = Σ_{k≤i} Q_k, V_i = M_i·G:
    C_i + R_i − R_{i−1} = Q_i           (flow: what is not served is demoted)
    C_i ≤ M_i·N_i,  R_i ≥ 0,  C_i ≥ 0
    R_i ≤ U_i·z_i                        (z_i = 0: nothing demoted)
    C_i ≥ M_i·N_i − V_i·(1 − z_i)        (z_i = 1: runtime i is full)
so a runtime demotes only when it is full: the paper's greedy fill, not a free
choice of demotion (`greedy=False` drops z_i and lets the solver demote freely,
a relaxation). The model has 5·I variables and about I·(K + 4) rows, so HiGHS
(`scipy.optimize.milp`) solves it in milliseconds even at 1,000 GPUs (`bench`).

If Eq. 3 cannot hold (Σ⌊Q_i/M_i⌋ > G: too few GPUs) the allocation is solved
without it and flagged `capacity_ok=False` — the signal to scale out.

CLI: `python -m polyserve.planner.arlo_ilp bench` prints solve times at
50/200/1,000 GPUs with 8/12/16 runtimes (Arlo, Gurobi: 0.156/0.623/2.612 s).
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# scipy.optimize is imported where the ILP is solved, not here: the planner imports this module at
# start-up, and most deployments never solve an Arlo allocation (an encoder deployment with the
# arlo scaler does). Importing it costs ~0.5 s and ~50 MB of memory (after numpy; Zen 4 EPYC, 2026-11-28)
# at every planner (re)start.


@dataclass(frozen=True)
class RuntimeProfile:
    """One compiled runtime: its length limit, capacity within the SLO and latency table.

    capacity: M_i, requests one instance serves within the SLO per SLO period.
    latency: ((load b, mean latency L_i(b) in ms), ...) at increasing loads b > 0.
    """

    name: str
    max_len: int
    capacity: float
    latency: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"runtime {self.name}: capacity must be > 0")
        loads = [b for b, _ in self.latency]
        if not loads or any(b <= 0 for b in loads) or loads != sorted(set(loads)):
            raise ValueError(f"runtime {self.name}: latency loads must be positive and increasing")
        if any(lat < 0 for _, lat in self.latency):
            raise ValueError(f"runtime {self.name}: latencies must be >= 0")


def from_runtime_spec(spec: Any) -> RuntimeProfile:
    """Adapt a profiled runtime with `name`, `max_length`, `capacity` and `latency_ms` (index
    b−1 for b = 1..len; the shape of `polyserve.proto.RuntimeProfile`). Loads beyond the
    table extrapolate its last segment (module docstring)."""
    lat = tuple((float(b), float(ms)) for b, ms in enumerate(spec.latency_ms, start=1))
    return RuntimeProfile(str(spec.name), int(spec.max_length),
                          float(spec.capacity), lat)


@dataclass(frozen=True)
class CostModel:
    """h(B) = B·L(B) as max_k(slope_k·B + intercept_k) (convex, h(0) = 0)."""

    slopes: tuple[float, ...]
    intercepts: tuple[float, ...]
    convexified: bool

    def total(self, load: float) -> float:
        """Per-instance total latency h(load) (ms × requests)."""
        if load <= 0:
            return 0.0
        return max(a * load + b for a, b in zip(self.slopes, self.intercepts))


def cost_model(profile: RuntimeProfile) -> CostModel:
    """Piecewise-linear h through (0,0) and (b, b·L(b)), replaced by its lower convex hull
    if it is not convex (see the module docstring)."""
    pts = [(0.0, 0.0)] + [(float(b), float(b) * float(lat)) for b, lat in profile.latency]
    hull: list[tuple[float, float]] = []
    for p in pts:  # lower hull (monotone chain); collinear points are kept, they change nothing
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) < -1e-9 * max(1.0, abs(p[1])):
            hull.pop()
        hull.append(p)
    convexified = len(hull) != len(pts)
    slopes, intercepts = [], []
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        a = (y1 - y0) / (x1 - x0)
        slopes.append(a)
        intercepts.append(y0 - a * x0)
    return CostModel(tuple(slopes), tuple(intercepts), convexified)


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True)
class Allocation:
    """The solver's answer. `objective` is Σ L_i(B_i)·C_i (ms × requests per SLO period)."""

    counts: tuple[int, ...]
    objective: float
    served: tuple[float, ...]  # C_i
    demoted: tuple[float, ...]  # R_i (overflow passed on to runtime i+1)
    mean_latency_ms: float
    capacity_ok: bool
    status: str
    solve_s: float
    convexified: tuple[str, ...] = ()
    optimum: float | None = None  # with `prefer`: the optimal objective the tie-break stayed within


def floors(demand: Sequence[float], profiles: Sequence[RuntimeProfile]) -> list[int]:
    """Eq. 3 lower bounds ⌊Q_i/M_i⌋ (and Eq. 7: at least one of the last runtime)."""
    lb = [math.floor(q / p.capacity + 1e-9) for q, p in zip(demand, profiles)]
    lb[-1] = max(lb[-1], 1)
    return lb


def evaluate(counts: Sequence[int], demand: Sequence[float], profiles: Sequence[RuntimeProfile],
             models: Sequence[CostModel] | None = None) -> tuple[float, list[float], list[float]]:
    """Objective, C and R of one allocation by Eqs. 1, 4–6 directly (for checks and brute force).

    An allocation that leaves demand at a runtime with no instance and no runtime after
    it is infeasible only for the last runtime (Eq. 7), which `counts` must satisfy.
    """
    models = models or [cost_model(p) for p in profiles]
    total, carried, served, demoted = 0.0, 0.0, [], []
    last = len(profiles) - 1
    for i, (n, q, p) in enumerate(zip(counts, demand, profiles)):
        want = carried + q
        c = want if i == last else min(want, n * p.capacity)
        carried = 0.0 if i == last else max(want - n * p.capacity, 0.0)
        served.append(c)
        demoted.append(carried)
        if n > 0:
            total += n * models[i].total(c / n)
        elif c > 1e-12:
            return math.inf, served, demoted
    return total, served, demoted


@dataclass
class _Milp:
    """The MILP of `solve`: variables N[0:I], C[I:2I], R[2I:3I], z[3I:4I], t[4I:5I]."""

    I: int
    lo: np.ndarray
    hi: np.ndarray
    integrality: np.ndarray
    rows: list[np.ndarray] = field(default_factory=list)
    rlo: list[float] = field(default_factory=list)
    rhi: list[float] = field(default_factory=list)

    @property
    def nv(self) -> int:
        return 5 * self.I

    def row(self, coef: Mapping[int, float], low: float, high: float) -> None:
        r = np.zeros(self.nv)
        for k, v in coef.items():
            r[k] += v
        self.rows.append(r)
        self.rlo.append(low)
        self.rhi.append(high)


def _check(G: int, demand: Sequence[float], profiles: Sequence[RuntimeProfile]) -> None:
    if len(profiles) == 0 or len(demand) != len(profiles):
        raise ValueError("need one demand figure per runtime and at least one runtime")
    if any(b.max_len > a.max_len for a, b in zip(profiles[1:], profiles)):
        raise ValueError("runtimes must be sorted by max_len")
    if G < 1:
        raise ValueError("G must be >= 1 (Eq. 7 needs one instance of the longest runtime)")


def _build(G: int, q: Sequence[float], profiles: Sequence[RuntimeProfile], models: Sequence[CostModel],
           lb: Sequence[int], greedy: bool) -> _Milp:
    """Bounds and rows of Eqs. 2–7 with the exact linearisation (module docstring)."""
    I = len(profiles)
    nN, nC, nR, nz, nt = 0, I, 2 * I, 3 * I, 4 * I
    m = _Milp(I, np.zeros(5 * I), np.full(5 * I, np.inf), np.zeros(5 * I))
    total_q = sum(q)
    cum_q = list(itertools.accumulate(q))
    for i in range(I):
        m.lo[nN + i], m.hi[nN + i], m.integrality[nN + i] = lb[i], G, 1
        m.hi[nC + i] = total_q
        m.hi[nR + i] = cum_q[i] if i < I - 1 else 0.0
        m.hi[nz + i] = 1.0 if (greedy and i < I - 1) else 0.0
        m.integrality[nz + i] = 1
    m.row({nN + i: 1.0 for i in range(I)}, G, G)  # Eq. 2
    for i, p in enumerate(profiles):
        flow = {nC + i: 1.0}
        if i < I - 1:
            flow[nR + i] = 1.0
        if i > 0:
            flow[nR + i - 1] = -1.0
        m.row(flow, q[i], q[i])  # Eqs. 4–5: served + demoted = demand + demoted from below
        if i < I - 1:
            m.row({nC + i: 1.0, nN + i: -p.capacity}, -np.inf, 0.0)  # C_i <= M_i N_i
            if greedy:
                m.row({nR + i: 1.0, nz + i: -cum_q[i]}, -np.inf, 0.0)  # R_i <= U_i z_i
                big = p.capacity * G
                m.row({nC + i: 1.0, nN + i: -p.capacity, nz + i: -big}, -big, np.inf)  # C_i >= M_i N_i - V_i(1-z_i)
        for a, b in zip(models[i].slopes, models[i].intercepts):
            m.row({nt + i: 1.0, nC + i: -a, nN + i: -b}, 0.0, np.inf)  # t_i >= a C_i + b N_i
    return m


def _options(time_limit_s: float, mip_rel_gap: float) -> dict[str, Any]:
    return {"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False}


def _fewest_moves(m: _Milp, G: int, prefer: Sequence[int], optimum: float, tolerance: float,
                  options: dict[str, Any]) -> np.ndarray | None:
    """Stage 2 of `solve`: within `tolerance` of `optimum`, minimise Σ max(0, prefer_i − N_i)
    with one more variable d_i ≥ prefer_i − N_i, d_i ≥ 0 per runtime; the x of the MILP, or
    None when the solver returns no point."""
    I, nv, nt = m.I, m.nv, 4 * m.I
    if len(prefer) != I or any(c < 0 for c in prefer):
        raise ValueError("prefer needs one non-negative instance count per runtime")
    A = np.hstack([np.array(m.rows), np.zeros((len(m.rows), I))])
    extra, elo, ehi = [], [], []
    bound = np.zeros(nv + I)
    bound[nt:nt + I] = 1.0
    extra.append(bound)  # Σ t_i <= optimum (1 + tolerance)
    elo.append(-np.inf)
    ehi.append(optimum * (1 + max(0.0, tolerance)) + 1e-7 * max(1.0, abs(optimum)))
    for i in range(I):
        r = np.zeros(nv + I)
        r[i] = r[nv + i] = 1.0  # N_i + d_i >= prefer_i
        extra.append(r)
        elo.append(float(prefer[i]))
        ehi.append(np.inf)
    from scipy.optimize import Bounds, LinearConstraint, milp

    cost = np.zeros(nv + I)
    cost[nv:] = 1.0
    res = milp(cost, constraints=LinearConstraint(np.vstack([A, np.array(extra)]), m.rlo + elo, m.rhi + ehi),
               integrality=np.concatenate([m.integrality, np.zeros(I)]),
               bounds=Bounds(np.concatenate([m.lo, np.zeros(I)]), np.concatenate([m.hi, np.full(I, float(G))])),
               options=options)
    return res.x[:nv] if res.x is not None else None


def solve(G: int, demand: Sequence[float], profiles: Sequence[RuntimeProfile], *, greedy: bool = True,
          time_limit_s: float = 10.0, mip_rel_gap: float = 1e-9, prefer: Sequence[int] | None = None,
          tolerance: float = 0.0) -> Allocation:
    """Solve Eqs. 1–7 exactly (module docstring). `demand[i]` = Q_i, requests per SLO period.

    `prefer` (the current instances per runtime) adds a second, lexicographic stage:
    among the allocations whose objective is within `tolerance` (a fraction) of the
    optimum, the one that takes the fewest instances away from their current runtime,
    Σ max(0, prefer_i − N_i), i.e. the fewest re-loads (§4). Many allocations tie when
    instances are under-loaded, so without it the solver's pick may move instances for
    nothing."""
    _check(G, demand, profiles)
    I = len(profiles)
    q = [max(0.0, float(x)) for x in demand]
    models = [cost_model(p) for p in profiles]
    lb = floors(q, profiles)
    capacity_ok = sum(lb) <= G
    if not capacity_ok:  # Eq. 3 cannot hold: solve without it, flag it
        lb = [0] * (I - 1) + [1]
    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = time.perf_counter()
    m = _build(G, q, profiles, models, lb, greedy)
    cost = np.zeros(m.nv)
    cost[4 * I:5 * I] = 1.0
    options = _options(time_limit_s, mip_rel_gap)
    res = milp(cost, constraints=LinearConstraint(np.array(m.rows), m.rlo, m.rhi), integrality=m.integrality,
               bounds=Bounds(m.lo, m.hi), options=options)
    if res.x is None:
        raise RuntimeError(f"Arlo allocation found no solution: {res.message}")
    x, optimum = res.x, None
    if prefer is not None:
        optimum = float(res.fun)
        x2 = _fewest_moves(m, G, prefer, optimum, tolerance, options)
        if x2 is not None:  # else keep the optimum (the stage-1 point is always feasible here)
            x = x2
    elapsed = time.perf_counter() - t0
    counts = tuple(int(round(v)) for v in x[:I])
    obj, served, demoted = evaluate(counts, q, profiles, models)
    total_q = sum(q)
    status = "optimal" if res.status == 0 else f"stopped: {res.message}"
    return Allocation(counts=counts, objective=obj, served=tuple(served), demoted=tuple(demoted),
                      mean_latency_ms=obj / total_q if total_q > 0 else 0.0, capacity_ok=capacity_ok,
                      status=status, solve_s=elapsed,
                      convexified=tuple(p.name for p, cm in zip(profiles, models) if cm.convexified),
                      optimum=optimum)


def brute_force(G: int, demand: Sequence[float], profiles: Sequence[RuntimeProfile]) -> tuple[float, tuple[int, ...]]:
    """Best allocation by enumerating every N with Σ N = G and Eqs. 3 and 7 (small G, I only)."""
    lb = floors(demand, profiles)
    if sum(lb) > G:
        lb = [0] * (len(profiles) - 1) + [1]
    models = [cost_model(p) for p in profiles]
    best: tuple[float, tuple[int, ...]] = (math.inf, ())
    for counts in _compositions(G, lb):
        obj = evaluate(counts, demand, profiles, models)[0]
        if obj < best[0] - 1e-12:
            best = (obj, counts)
    return best


def _compositions(total: int, lb: Sequence[int]):
    if len(lb) == 1:
        if total >= lb[0]:
            yield (total,)
        return
    for n in range(lb[0], total - sum(lb[1:]) + 1):
        for rest in _compositions(total - n, lb[1:]):
            yield (n, *rest)


# --------------------------------------------------------------------------- demand
def ideal_runtime(length: int, max_lens: Sequence[int]) -> int:
    """Index of the shortest runtime whose max_len fits `length` (the last one if none)."""
    for i, m in enumerate(max_lens):
        if length <= m:
            return i
    return len(max_lens) - 1


def demand_per_slo(lengths: Sequence[int], period_s: float, slo_s: float, max_lens: Sequence[int]) -> list[float]:
    """Q_i from the request lengths seen over the last `period_s`: the mean count per SLO period."""
    counts = [0] * len(max_lens)
    for n in lengths:
        counts[ideal_runtime(n, max_lens)] += 1
    return [c * slo_s / period_s for c in counts]


# --------------------------------------------------------------------------- replacement (§4)
@dataclass(frozen=True)
class Replacement:
    """Re-load one instance with another runtime (`instance` None: a new GPU; `to` None: release it)."""

    instance: str | None
    src: int | None
    dst: int | None


@dataclass(frozen=True)
class ReplacementPlan:
    steps: tuple[Replacement, ...]
    batches: tuple[tuple[Replacement, ...], ...] = field(default=())

    @property
    def changes(self) -> int:
        return len(self.steps)


def replacement_plan(current: Mapping[str, int], target: Sequence[int],
                     load: Mapping[str, float] | None = None, batch_size: int = 2) -> ReplacementPlan:
    """The fewest instance changes turning `current` (instance -> runtime index) into `target`
    counts (Arlo §4), in batches of `batch_size` so uninvolved instances see little disruption.

    Each runtime with s_i = cur_i − N_i > 0 surplus must give up at least s_i instances, so
    no plan has fewer than Σ max(0, cur_i − N_i) re-loads plus the GPUs added or released;
    this plan has exactly that many. The least loaded instances move first; a surplus
    instance goes to the deficit runtime nearest in index (closest max_len), released
    instances (fewer GPUs) come from the surplus first and new GPUs fill deficits last.
    """
    load = load or {}
    cur = [0] * len(target)
    by_rt: dict[int, list[str]] = {i: [] for i in range(len(target))}
    for inst, rt in current.items():
        if not 0 <= rt < len(target):
            raise ValueError(f"instance {inst} runs unknown runtime {rt}")
        cur[rt] += 1
        by_rt[rt].append(inst)
    for rt in by_rt:
        by_rt[rt].sort(key=lambda w: (load.get(w, 0.0), w), reverse=True)  # pop() = least loaded
    surplus = [(i, c - t) for i, (c, t) in enumerate(zip(cur, target)) if c > t]
    deficit = {i: t - c for i, (c, t) in enumerate(zip(cur, target)) if t > c}
    movers = sorted(((by_rt[i].pop(), i) for i, s in surplus for _ in range(s)),
                    key=lambda m: (load.get(m[0], 0.0), m[0]))
    release = max(0, len(current) - sum(target))
    steps = [Replacement(inst, src, None) for inst, src in movers[:release]]  # least loaded first
    for inst, src in movers[release:]:
        dst = min(deficit, key=lambda d: (abs(d - src), d))
        steps.append(Replacement(inst, src, dst))
        deficit[dst] -= 1
        if deficit[dst] == 0:
            del deficit[dst]
    for dst in sorted(deficit):
        steps.extend(Replacement(None, None, dst) for _ in range(deficit[dst]))
    size = max(1, batch_size)
    batches = tuple(tuple(steps[k:k + size]) for k in range(0, len(steps), size))
    return ReplacementPlan(tuple(steps), batches)


PERIOD_S = 120.0  # Arlo §5 (parameter settings): the Runtime Scheduler re-solves every 120 s


def plan_period(current: Mapping[str, int], profiles: Sequence[RuntimeProfile], lengths: Sequence[int],
                period_s: float, slo_s: float, load: Mapping[str, float] | None = None,
                batch_size: int = 2) -> tuple[Allocation, ReplacementPlan]:
    """One Runtime Scheduler period: Q_i from the lengths seen, the optimal N_i for the
    instances in `current` (G = len(current)), and the fewest replacements to get there."""
    demand = demand_per_slo(lengths, period_s, slo_s, [p.max_len for p in profiles])
    alloc = solve(len(current), demand, profiles)
    return alloc, replacement_plan(current, alloc.counts, load, batch_size)
