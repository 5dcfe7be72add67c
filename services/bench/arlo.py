"""`polyserve bench arlo solve|replan`: Arlo's runtime allocation as the planner runs it.

* `solve`: solve time of the exact MILP (`polyserve.planner.arlo_ilp.solve`, scipy/HiGHS)
  on synthetic BERT-like instances, beside Arlo's published Gurobi figures (Table 2);
* `replan`: one period of the live re-plan (`polyserve.planner.arlo_live.compute_plan`,
  with and without the fewest-moves stage) on an encoder profile.

Prints tables; the figures are this CPU's."""
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import numpy as np

from polyserve.planner import arlo_live
from polyserve.planner.arlo_ilp import RuntimeProfile, ideal_runtime, solve


def synthetic_instance(G: int, I: int, load: float = 0.8, seed: int = 0, step: int = 64,
                       slo_ms: float = 400.0) -> tuple[list[float], list[RuntimeProfile]]:
    """A BERT-like instance: runtimes every `step` tokens, latency rising with max length and
    load, log-normal request lengths, demand such that the ideal runtimes alone would need
    `load` × G GPUs (Σ Q_i/M_i = load·G). Synthetic, not a trace."""
    rng = np.random.default_rng(seed)
    profiles = []
    for i in range(I):
        max_len = step * (i + 1)
        single = 2.0 + 0.04 * max_len * (1 + 0.05 * rng.standard_normal())  # ms, grows with padding
        per_req = 0.35 * single
        cap = max(1, int((slo_ms - single) // per_req) + 1)  # largest b with L(b) <= slo
        lat = tuple((float(b), single + per_req * (b - 1)) for b in range(1, cap + 1))
        profiles.append(RuntimeProfile(f"rt{max_len}", max_len, float(cap), lat))
    lengths = np.clip(rng.lognormal(np.log(step * I / 5), 0.8, 20_000), 1, step * I).astype(int)
    share = np.bincount([ideal_runtime(int(n), [p.max_len for p in profiles]) for n in lengths],
                        minlength=I) / len(lengths)
    gpus_per_request = float(np.dot(share, [1.0 / p.capacity for p in profiles]))
    total = load * G / gpus_per_request  # Σ Q_i/M_i = load × G: the ideal runtimes alone need load × G GPUs
    return [float(total * s) for s in share], profiles


def bench(configs: Sequence[tuple[int, int]] = ((50, 8), (200, 12), (1000, 16)),
          loads: Sequence[float] = (0.5, 0.8, 0.95), repeats: int = 5) -> list[dict]:
    """Solve-time figures like Arlo's Table 2 (synthetic instances, this machine's CPU)."""
    out = []
    for G, I in configs:
        times, gaps = [], []
        for load in loads:
            for seed in range(repeats):
                demand, profiles = synthetic_instance(G, I, load, seed)
                a = solve(G, demand, profiles)
                times.append(a.solve_s)
                gaps.append(a.status)
        out.append({"gpus": G, "runtimes": I, "runs": len(times), "mean_s": float(np.mean(times)),
                    "max_s": float(np.max(times)), "all_optimal": all(s == "optimal" for s in gaps)})
    return out


def solve_table(args: argparse.Namespace) -> int:
    """`polyserve bench arlo solve`: solve time at 50/200/1,000 GPUs with 8/12/16 runtimes."""
    loads = tuple(float(x) for x in args.loads.split(","))
    print("Arlo runtime allocation, scipy.optimize.milp (HiGHS), synthetic BERT-like instances")
    print(f"{'GPUs':>6} {'runtimes':>9} {'runs':>5} {'mean s':>9} {'max s':>9} {'optimal':>8}  Arlo+Gurobi")
    paper = {(50, 8): 0.156, (200, 12): 0.623, (1000, 16): 2.612}
    for r in bench(loads=loads, repeats=args.repeats):
        print(f"{r['gpus']:>6} {r['runtimes']:>9} {r['runs']:>5} {r['mean_s']:>9.4f} {r['max_s']:>9.4f} "
              f"{r['all_optimal']!s:>8}  {paper.get((r['gpus'], r['runtimes']), float('nan')):.3f} s")
    return 0


def replan_table(args: argparse.Namespace) -> int:
    """`polyserve bench arlo replan`: plan time and re-loads of one period on a profile, G
    instances all starting at the longest runtime, log-normal lengths."""
    rt = arlo_live.load_runtimes(args.profile)
    print(f"profile {rt.path}: runtimes {rt.max_lens}, SLO {rt.slo_ms:g} ms")
    for G in args.gpus:
        rng = random.Random(args.seed)
        lengths = [min(rt.max_lens[-1], max(3, int(rng.lognormvariate(4.0, 0.8))))
                   for _ in range(int(args.rate_per_gpu * G * args.period_s))]
        cur = {f"w{i}": len(rt.specs) - 1 for i in range(G)}
        out = []
        for fewest in (True, False):
            t = time.perf_counter()
            plan, _ = arlo_live.compute_plan("bench", cur, rt, lengths, args.period_s, fewest_moves=fewest)
            out.append(((time.perf_counter() - t) * 1e3, plan))
        (ms, plan), (ms_any, plan_any) = out
        counts = ", ".join(f"l{s.max_length}:{plan.counts[s.name]}" for s in rt.specs if plan.counts[s.name])
        print(f"G={G:4d} {len(lengths):6d} requests/{args.period_s:g}s: plan {ms:7.1f} ms, {plan.changes:3d} re-loads "
              f"(solver's optimum as is: {ms_any:6.1f} ms, {plan_any.changes} re-loads); {counts}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="polyserve bench arlo", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("solve", help="MILP solve time at 50/200/1,000 GPUs with 8/12/16 runtimes")
    s.add_argument("--repeats", type=int, default=5, help="seeds per load level")
    s.add_argument("--loads", default="0.5,0.8,0.95", help="demand as a fraction of cluster capacity")
    s.set_defaults(fn=solve_table)
    r = sub.add_parser("replan", help="the live planner's re-plan (fewest-moves stage) on an encoder profile")
    r.add_argument("--profile", default=str(arlo_live.SHIPPED_PROFILE))
    r.add_argument("--gpus", type=int, nargs="+", default=[3, 16, 64])
    r.add_argument("--rate-per-gpu", type=float, default=0.25, help="requests/s per instance over the period")
    r.add_argument("--period-s", type=float, default=120.0)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(fn=replan_table)
    args = ap.parse_args(argv)
    return args.fn(args)
