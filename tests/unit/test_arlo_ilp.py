"""Arlo's runtime allocation (MILP) against brute force, demotion, and the minimal
replacement plan (Arlo §3.3, §4)."""
import itertools
import math
import random

import pytest

from polyserve.bench import arlo as arlo_bench
from polyserve.bench.arlo import synthetic_instance
from polyserve.planner import arlo_ilp as arlo
from polyserve.planner.arlo_ilp import Replacement, RuntimeProfile

pytestmark = pytest.mark.unit


def linear_profile(name, max_len, single_ms, per_req_ms, cap):
    return RuntimeProfile(name, max_len, float(cap),
                          tuple((float(b), single_ms + per_req_ms * (b - 1)) for b in range(1, cap + 1)))


def random_instance(seed):
    rnd = random.Random(seed)
    I = rnd.randint(2, 4)
    G = rnd.randint(I, 9)
    profiles = []
    for i in range(I):
        single = rnd.uniform(2, 10) * (i + 1)
        cap = rnd.randint(2, 6)
        lat = [(float(b), single * (1 + rnd.uniform(0.1, 0.6) * (b - 1))) for b in range(1, cap + 1)]
        if rnd.random() < 0.2:  # a non-convex profile: exercised through the hull
            lat = [(b, t * (0.8 if b == 2 else 1.0)) for b, t in lat]
        profiles.append(RuntimeProfile(f"r{i}", 64 * (i + 1), float(cap), tuple(lat)))
    return G, [rnd.uniform(0, 8) for _ in range(I)], profiles


@pytest.mark.parametrize("seed", range(60))
def test_milp_objective_equals_brute_force(seed):
    G, demand, profiles = random_instance(seed)
    got = arlo.solve(G, demand, profiles)
    best, counts = arlo.brute_force(G, demand, profiles)
    assert got.status == "optimal"
    assert sum(got.counts) == G and got.counts[-1] >= 1  # Eqs. 2 and 7
    assert got.objective == pytest.approx(best, rel=1e-7, abs=1e-7), (got.counts, counts)
    # the MILP's own evaluation of its answer is the paper's Eqs. 4-6 evaluated directly
    assert got.objective == pytest.approx(arlo.evaluate(got.counts, demand, profiles)[0], rel=1e-9)
    if got.capacity_ok:
        assert all(n >= lb for n, lb in zip(got.counts, arlo.floors(demand, profiles)))  # Eq. 3


def test_overflow_is_demoted_to_the_next_longer_runtime():
    # two GPUs for runtime 0 cannot be afforded: one instance of r0 (capacity 4) takes 4 of
    # the 6 short requests and the other 2 are demoted to r1 (Eqs. 4-5)
    profiles = [linear_profile("r64", 64, 2.0, 1.0, 4), linear_profile("r128", 128, 4.0, 1.0, 8)]
    got = arlo.solve(2, [6.0, 1.0], profiles)
    assert got.counts == (1, 1)
    assert got.served == pytest.approx((4.0, 3.0)) and got.demoted == pytest.approx((2.0, 0.0))
    # by hand: r0 serves 4 at L(4) = 5 ms, r1 serves 3 at L(3) = 6 ms
    assert got.objective == pytest.approx(4 * 5.0 + 3 * 6.0)
    assert got.mean_latency_ms == pytest.approx((20.0 + 18.0) / 7)


def test_greedy_fill_is_exact_and_free_demotion_is_a_relaxation():
    # r0 is slow under load, so a free choice would demote voluntarily; the paper's
    # Eqs. 4-5 fill the ideal runtime first, and `greedy=True` keeps to them
    profiles = [linear_profile("r64", 64, 1.0, 5.0, 6), linear_profile("r128", 128, 2.0, 0.1, 20)]
    exact = arlo.solve(3, [6.0, 1.0], profiles)
    free = arlo.solve(3, [6.0, 1.0], profiles, greedy=False)
    assert exact.objective == pytest.approx(arlo.brute_force(3, [6.0, 1.0], profiles)[0])
    assert free.solve_s >= 0 and free.counts and sum(free.counts) == 3


def test_too_few_gpus_is_flagged_not_failed():
    profiles = [linear_profile("r64", 64, 2.0, 1.0, 2), linear_profile("r128", 128, 4.0, 1.0, 2)]
    got = arlo.solve(2, [9.0, 9.0], profiles)  # Eq. 3 needs 4 + 4 GPUs
    assert not got.capacity_ok and sum(got.counts) == 2 and got.counts[-1] >= 1
    assert got.objective == pytest.approx(arlo.brute_force(2, [9.0, 9.0], profiles)[0])


def test_non_convex_profile_is_convexified_and_named():
    bumpy = RuntimeProfile("bumpy", 64, 4.0, ((1.0, 10.0), (2.0, 4.0), (3.0, 6.0), (4.0, 8.0)))
    model = arlo.cost_model(bumpy)
    assert model.convexified
    assert model.total(0) == 0 and model.total(4) == pytest.approx(32.0)
    got = arlo.solve(2, [3.0, 1.0], [bumpy, linear_profile("r128", 128, 2.0, 1.0, 4)])
    assert got.convexified == ("bumpy",)
    assert not arlo.cost_model(linear_profile("lin", 64, 2.0, 1.0, 5)).convexified


def test_adapts_a_profiled_runtime_record():
    import types
    spec = types.SimpleNamespace(name="static-b4-l128", max_length=128, capacity=6, latency_ms=[3.0, 4.0, 5.5, 7.0])
    p = arlo.from_runtime_spec(spec)
    assert (p.name, p.max_len, p.capacity) == ("static-b4-l128", 128, 6.0)
    assert p.latency == ((1.0, 3.0), (2.0, 4.0), (3.0, 5.5), (4.0, 7.0))


def test_input_validation_and_demand_binning():
    p = [linear_profile("a", 128, 1, 1, 2), linear_profile("b", 64, 1, 1, 2)]
    with pytest.raises(ValueError):
        arlo.solve(2, [1, 1], p)  # unsorted
    with pytest.raises(ValueError):
        arlo.solve(0, [1], p[:1])
    with pytest.raises(ValueError):
        RuntimeProfile("x", 64, 0.0, ((1.0, 1.0),))
    assert [arlo.ideal_runtime(n, [64, 128, 192]) for n in (1, 64, 65, 192, 500)] == [0, 0, 1, 2, 2]
    # 120 s of lengths, SLO 0.5 s: Q_i = count × 0.5 / 120
    assert arlo.demand_per_slo([10, 20, 100, 700], 120.0, 0.5, [64, 128]) == pytest.approx(
        [2 * 0.5 / 120, 2 * 0.5 / 120])


def test_solves_a_thousand_gpus_with_sixteen_runtimes_fast():
    demand, profiles = synthetic_instance(1000, 16, load=0.8, seed=1)
    got = arlo.solve(1000, demand, profiles)
    assert got.status == "optimal" and sum(got.counts) == 1000 and got.capacity_ok
    assert got.solve_s < 5.0  # Arlo (Gurobi) reports 2.6 s; `bench` prints the figures


# --------------------------------------------------------------------------- replacement plan (§4)
def apply(current, plan):
    cur = dict(current)
    for i, step in enumerate(plan.steps):
        if step.instance is None:
            cur[f"new{i}"] = step.dst
        elif step.dst is None:
            del cur[step.instance]
        else:
            assert cur[step.instance] == step.src
            cur[step.instance] = step.dst
    return cur


def counts_of(assign, n):
    return [sum(1 for r in assign.values() if r == i) for i in range(n)]


def test_replacement_plan_is_minimal_and_reaches_the_target():
    current = {"g0": 0, "g1": 0, "g2": 0, "g3": 1, "g4": 2, "g5": 2}
    target = [1, 3, 2]
    plan = arlo.replacement_plan(current, target, load={"g0": 5, "g1": 0, "g2": 9}, batch_size=1)
    assert plan.changes == 2  # Σ max(0, cur − target) = 2
    assert counts_of(apply(current, plan), 3) == target
    assert {s.instance for s in plan.steps} == {"g1", "g0"}  # the least loaded of runtime 0 move
    assert plan.steps[0] == Replacement("g1", 0, 1)
    assert len(plan.batches) == 2


@pytest.mark.parametrize("seed", range(30))
def test_replacement_plan_changes_no_more_than_the_lower_bound(seed):
    rnd = random.Random(seed)
    n_rt = rnd.randint(2, 4)
    current = {f"g{i}": rnd.randrange(n_rt) for i in range(rnd.randint(1, 8))}
    total = max(1, len(current) + rnd.randint(-2, 2))
    cuts = sorted(rnd.randint(0, total) for _ in range(n_rt - 1))
    target = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    plan = arlo.replacement_plan(current, target)
    cur = counts_of(current, n_rt)
    lower = sum(max(0, c - t) for c, t in zip(cur, target)) + max(0, sum(target) - len(current))
    assert plan.changes == lower
    assert counts_of(apply(current, plan), n_rt) == target
    if len(current) <= 6 and sum(target) == len(current):  # exhaustive: no re-assignment does better
        best = min(sum(1 for r, r2 in zip(current.values(), perm) if r != r2)
                   for perm in itertools.product(range(n_rt), repeat=len(current))
                   if counts_of(dict(zip(current, perm)), n_rt) == target)
        assert plan.changes == best


def test_one_period_allocates_from_lengths_and_plans_replacements():
    profiles = [linear_profile("r64", 64, 2.0, 1.0, 8), linear_profile("r128", 128, 4.0, 1.0, 8)]
    current = {"g0": 1, "g1": 1, "g2": 1}  # everything on the long runtime (Arlo's scale-out default)
    lengths = [30] * 2400 + [100] * 240  # 120 s: 10 short req/s and 1 long req/s; SLO 0.5 s
    alloc, plan = arlo.plan_period(current, profiles, lengths, arlo.PERIOD_S, 0.5)
    assert alloc.counts == (2, 1) and alloc.capacity_ok
    assert plan.changes == 2 and all(s.src == 1 and s.dst == 0 for s in plan.steps)


def test_bench_reports_all_sizes():
    rows = arlo_bench.bench(configs=((50, 8),), loads=(0.8,), repeats=1)
    assert rows[0]["gpus"] == 50 and rows[0]["runtimes"] == 8 and rows[0]["all_optimal"]
    assert math.isfinite(rows[0]["mean_s"])


# --------------------------------------------------------------------------- live re-plan (arlo_live)
def shipped_runtimes():
    from polyserve.planner import arlo_live

    return arlo_live.load_runtimes(arlo_live.SHIPPED_PROFILE)


def test_live_plan_moves_instances_to_the_runtimes_the_lengths_need():
    from polyserve.planner import arlo_live

    rt = shipped_runtimes()
    assert rt.max_lens == sorted(rt.max_lens) and rt.slo_ms > 0
    last = len(rt.specs) - 1
    current = {"w0": last, "w1": last, "w2": last}  # three l512 instances
    lengths = [40] * 600 + [300] * 60  # 120 s of mostly short inputs
    plan, steps = arlo_live.compute_plan("emb", current, rt, lengths, 120.0, {"w0": 3.0, "w1": 0.0, "w2": 1.0})
    demand = arlo.demand_per_slo(lengths, 120.0, rt.slo_ms / 1e3, rt.max_lens)
    alloc = arlo.solve(3, demand, rt.ilp)
    assert plan.counts == {n: c for n, c in zip(rt.names, alloc.counts)} and sum(plan.counts.values()) == 3
    assert plan.previous == {**{n: 0 for n in rt.names}, rt.names[-1]: 3}
    assert plan.counts[rt.names[0]] >= 1 and plan.counts[rt.names[-1]] >= 1  # short bin served; Eq. 7
    assert plan.changes == steps.changes == 3 - plan.counts[rt.names[-1]]
    assert steps.steps[0].instance == "w1"  # the least loaded moves first
    assert plan.rates[rt.names[0]] == pytest.approx(600 / 120) and plan.objective == pytest.approx(alloc.objective)
    env = arlo_live.runtime_env(rt.specs[0], "/p.json")
    assert env["POLYSERVE_WORKER_ENCODER_MAX_LENGTH"] == str(rt.max_lens[0])
    assert env["POLYSERVE_WORKER_ENCODER_PROFILE"] == "/p.json"


def test_live_plan_keeps_runtimes_without_traffic_or_without_enough_gain():
    from polyserve.planner import arlo_live

    rt = shipped_runtimes()
    last = len(rt.specs) - 1
    plan, steps = arlo_live.compute_plan("emb", {"w0": 0, "w1": last}, rt, [], 120.0)
    assert steps.changes == plan.changes == 0 and plan.counts == plan.previous and "no request" in plan.reason
    lengths = [40] * 600 + [500] * 10
    optimal, _ = arlo_live.compute_plan("emb", {"w0": last, "w1": last}, rt, lengths, 120.0)
    target = {}
    for name, n in optimal.counts.items():  # the optimum itself, as instances
        target.update({f"{name}-{k}": rt.names.index(name) for k in range(n)})
    same, st = arlo_live.compute_plan("emb", target, rt, lengths, 120.0)
    assert st.changes == 0 and same.counts == optimal.counts and "optimal" in same.reason
    # a huge min_gain keeps any feasible allocation
    kept, st = arlo_live.compute_plan("emb", {"w0": last, "w1": last}, rt, lengths, 120.0, min_gain=100.0)
    assert st.changes == 0 and "within" in kept.reason


def test_live_profile_errors_say_what_to_fix(tmp_path):
    from polyserve.planner import arlo_live

    with pytest.raises(ValueError, match="cannot read the encoder profile"):
        arlo_live.load_runtimes(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError, match="not an EncoderProfile"):
        arlo_live.load_runtimes(bad)
    assert arlo_live.instance_runtime(80, [80, 152, 512]) == 0
    assert arlo_live.instance_runtime(100, [80, 152, 512]) == 1
    assert arlo_live.instance_runtime(9999, [80, 152, 512]) == 2


@pytest.mark.parametrize("seed", range(12))
def test_prefer_moves_the_fewest_instances_within_tolerance(seed):
    G, demand, profiles = random_instance(seed)
    rnd = random.Random(100 + seed)
    prefer = [0] * len(profiles)
    for _ in range(G):
        prefer[rnd.randrange(len(profiles))] += 1
    tol = rnd.choice([0.0, 0.05, 0.3])
    best, _ = arlo.brute_force(G, demand, profiles)
    got = arlo.solve(G, demand, profiles, prefer=prefer, tolerance=tol)
    assert got.optimum == pytest.approx(best, rel=1e-6, abs=1e-6)
    assert got.objective <= best * (1 + tol) + 1e-6
    moves = lambda counts: sum(max(0, p - n) for p, n in zip(prefer, counts))  # noqa: E731
    lb = arlo.floors(demand, profiles)
    if sum(lb) > G:
        lb = [0] * (len(profiles) - 1) + [1]
    fewest = min(moves(c) for c in arlo._compositions(G, lb)
                 if arlo.evaluate(c, demand, profiles)[0] <= best * (1 + tol) + 1e-9)
    assert moves(got.counts) == fewest
