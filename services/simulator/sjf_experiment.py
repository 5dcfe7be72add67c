"""The speculative-SJF experiment (docs/experiments/sjf.md): one worker, loads as fractions
of its saturation, FCFS vs SSJF (old: `ssjf_class`, aging 120 s per class) vs SSJF (new:
`ssjf`, size with a bounded overtake window and, as in a live worker, the overtake bound;
`ssjf_noguard`: the same without any guard) vs oracle SJF (true output length). SIMULATED.

    python -m polyserve.simulator.sjf_experiment --out experiments-out/sjf

Saturation of one worker on a trace: its first N requests all queued at t = 0 under FCFS;
requests completed while the queue was still non-empty ÷ that time (the most it can serve
when it never runs dry). Load L replays the trace's own timeline (its bursts kept) rescaled
to L × saturation, first N requests. "% of oracle gain" = (FCFS − SSJF) ÷ (FCFS − oracle)
in mean JCT, left out ("n/a") where the oracle's cut is under 1%.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from polyserve.core import profiles
from polyserve.core import queue_order as qo
from polyserve.core.perf import load_perf
from polyserve.core.profiles import profile_path
from polyserve.simulator import report
from polyserve.simulator.cluster import SimConfig, simulate
from polyserve.simulator.engine import WorkerConfig
from polyserve.simulator.limits import context_limit, profiled_prompt_tokens
from polyserve.simulator.predictor import LengthPredictor, resolve_confusion
from polyserve.simulator.trace import Trace, datasets_dir, load_trace, window

ALL_ORDERS = (("fcfs", "FCFS", "fcfs", {}), ("ssjf_class", "SSJF (old)", "ssjf_class", {"aging_s": 120.0}),
              ("ssjf", "SSJF", "ssjf", {}), ("ssjf_noguard", "SSJF without guards", "ssjf", {"noguard": True}),
              ("ssjf_refine", "SSJF + refine", "ssjf", {"refine": True}),
              ("ssjf_client", "SSJF + refine by client", "ssjf", {"refine": True, "by_client": True}),
              ("ssjf_true", "SSJF + refine on true lengths", "ssjf", {"refine": True, "true_lengths": True}),
              ("sjf_oracle", "oracle SJF", "sjf_oracle", {}), ("srpt_oracle", "oracle SRPT", "sjf_oracle", {"refine": True}))
"""(name, label, the simulator's order, options). The ssjf rows carry the guards (--overtake-bound,
--tail-guard, as a live worker's ssjf) but `ssjf_noguard`, the rule as it was served before 2026-11-26. `+ refine`
/ SRPT: preemptive at iteration boundaries (WorkerConfig.refine_preempt, pause with KV kept; the
oracle with its true remaining length, the same preemption rules)."""
ALIASES = {"ssjf_guard": "ssjf"}
"""Earlier names in --orders: `ssjf_guard` (plain ssjf with the guard) is what `ssjf` is now."""
DEFAULT_ORDERS = tuple(o for o in ALL_ORDERS if o[0] not in ("ssjf_class", "ssjf_true", "ssjf_noguard"))
ORDERS = DEFAULT_ORDERS
ORACLES = ("sjf_oracle", "srpt_oracle")
LONG_CONTEXT = 131072


def default_traces() -> list[tuple[str, int]]:
    """(trace spec, context limit: 0 = the profile's) of the experiment."""
    d = datasets_dir()
    t = d / "traces"
    return [(str(t / "azure_llm_2023_conv.csv"), 0), (str(t / "azure_llm_2023_code.csv"), 0),
            (str(t / "mooncake_fast25_synthetic_trace.jsonl"), LONG_CONTEXT),
            (f"servegen:{t / 'servegen' / 'language' / 'm-large'}:36000:60", 0),
            (f"servegen:{t / 'servegen' / 'reason' / 'deepseek-r1'}:36000:3600", LONG_CONTEXT),
            (f"muserve:{d / 'predictor_baselines' / 'ssjf_vicuna13b_lmsys_predictions_warmup_multi_cls_1000K.csv'}",
             0)]


def _head(t: Trace, n: int) -> Trace:
    pc = t.predicted_class[:n] if t.predicted_class is not None else None
    cl = t.client[:n] if t.client is not None else None
    return Trace(t.name, t.arrival[:n], t.input_len[:n], t.output_len[:n], None, pc, t.class_bounds, cl)


def saturation(tr: Trace, perf, cfg: SimConfig, n: int) -> float:
    """Requests per second one worker completes while its queue is non-empty (module docstring)."""
    res = simulate(_head(window(tr, rate_scale=1e5), n), perf, replace(cfg, order="fcfs"))
    served = [r for r in res.requests if not r.rejected]
    last = max(r.admitted for r in served)
    return sum(1 for r in served if r.finish <= last) / last


def _predictor(full: Trace, tr: Trace, confusion, name: str, seed: int) -> LengthPredictor:
    """The trace's own predictions for the requests run (`tr`), else the confusion model with
    classes and class means of the whole trace (`full`)."""
    if tr.predicted_class is not None:
        return LengthPredictor("real", tr.output_len, bounds=tr.class_bounds, given_classes=tr.predicted_class,
                               seed=seed, name=f"real: µ-Serve's published SSJF predictions ({full.name})")
    return LengthPredictor("confusion", full.output_len, confusion=confusion, seed=seed, name=f"confusion: {name}")


def run_trace(spec: str, ctx: int, perf, raw: dict, base: SimConfig, loads, n: int, confusion, cname: str,
              seed: int) -> list[dict]:
    """Every order at every load on one trace; one row per (load, order)."""
    full = load_trace(spec, seed=seed)
    cfg = replace(base, context_limit=ctx or base.context_limit)
    sat = saturation(full, perf, cfg, n)
    rows = []
    for load in loads:
        tr = _head(window(full, rate_scale=load * sat / full.rate), n)
        pred = _predictor(full, tr, confusion, cname, seed)
        for order, label, sim_order, kw in ORDERS:
            if kw.get("by_client") and tr.client is None:
                continue  # no client ids in this trace: the same runs as + refine
            sim_kw = {k: v for k, v in kw.items() if k not in ("refine", "by_client", "true_lengths", "noguard")}
            run_cfg = replace(cfg, order=sim_order, **sim_kw)
            if kw.get("noguard"):  # ssjf_noguard: the size rule alone, as plain ssjf was served before
                run_cfg = replace(run_cfg, worker=replace(run_cfg.worker, tail_guard=0.0, overtake_bound=0.0))
            if kw.get("refine"):
                run_cfg = replace(run_cfg, worker=replace(run_cfg.worker, refine_preempt=True,
                                                          refine_by_client=bool(kw.get("by_client"))))
            # ssjf_true: the same rule and bound fed true lengths (what the predictor costs, apart from the bound)
            used = LengthPredictor("oracle", full.output_len, name="oracle: true lengths (ssjf_true only)") \
                if kw.get("true_lengths") else pred
            res = simulate(tr, perf, run_cfg, predictor=used)
            lat = report.latencies(res)
            rows.append({"trace": full.name, "load": load, "rate": round(tr.rate, 4), "saturation_rps": sat,
                         "order": order, "label": label, "requests": len(tr), "served": int(lat.e2e.size),
                         "mean_s": float(lat.e2e.mean()) / 1000, "p99_s": float(np.percentile(lat.e2e, 99)) / 1000,
                         "counters": res.counters, "predictor": used.name, "context_limit": cfg.context_limit})
    return rows


def table(rows: list[dict]) -> str:
    """Mean and P99 JCT per trace and load, % of each oracle's cut, P99 vs FCFS."""
    have = {r["order"] for r in rows}
    label = {o[0]: o[1] for o in ALL_ORDERS}
    cols = [o[0] for o in ALL_ORDERS if o[0] in have and o[0] != "fcfs" and o[0] not in ORACLES]
    oracles = [o for o in ORACLES if o in have]
    head = ("| trace | load (req/s) | FCFS mean / P99 | "
            + " | ".join(f"{label[c]} mean / P99" for c in cols + oracles)
            + "".join(f" | % of {label[o]}'s cut: " + " / ".join(label[c] for c in cols) for o in oracles)
            + " | P99 ÷ FCFS " + " / ".join(label[c] for c in cols) + " |")
    out = [head, "|" + "---|" * (3 + len(cols) + 2 * len(oracles))]
    for key in dict.fromkeys((r["trace"], r["load"]) for r in rows):
        g = {r["order"]: r for r in rows if (r["trace"], r["load"]) == key}
        f = g["fcfs"]
        out.append(f"| {key[0]} | {key[1]:g} ({f['rate']:.2f}) | {_cell(f)} | "
                   + " | ".join(_cell(g.get(c)) + (f" ({100 * (g[c]['mean_s'] / f['mean_s'] - 1):+.0f}%)"
                                                  if c in oracles else "") for c in cols + oracles)
                   + "".join(" | " + " / ".join(_share(f, g.get(c), g[o]) for c in cols) for o in oracles) + " | "
                   + " / ".join(f"{g[c]['p99_s'] / f['p99_s']:.2f}" if c in g else "—" for c in cols) + " |")
    return "\n".join(out)


def _cell(r: dict | None) -> str:
    return "—" if r is None else f"{r['mean_s']:.1f} / {r['p99_s']:.1f} s"


def _share(fcfs: dict, r: dict | None, oracle: dict) -> str:
    """% of the oracle's cut in mean JCT that `r` earns; n/a where the oracle cuts under 1%."""
    if r is None:
        return "—"
    cut = fcfs["mean_s"] - oracle["mean_s"]
    return f"{100 * (fcfs['mean_s'] - r['mean_s']) / cut:.0f}%" if cut > 0.01 * fcfs["mean_s"] else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m polyserve.simulator.sjf_experiment", description=__doc__)
    ap.add_argument("--trace", action="append", default=None,
                    help="trace spec (see polyserve simulate --trace), repeatable; default: the six of sjf.md")
    ap.add_argument("--only", default="", help="of the default traces, those whose spec holds one of these (comma-separated)")
    ap.add_argument("--loads", default="0.7,0.8,0.9,1.0", help="fractions of one worker's saturation")
    ap.add_argument("--requests", type=int, default=4000, help="first N requests of each trace")
    ap.add_argument("--confusion", default=None, help="as polyserve simulate --confusion")
    ap.add_argument("--profile", default=str(profile_path(profiles.DEFAULT_SIM)))
    ap.add_argument("--window-factor", type=float, default=0.0,
                    help="ssjf: W = this x the recent mean JCT (0 = core.queue_order.WINDOW_FACTOR)")
    ap.add_argument("--orders", default=",".join(o[0] for o in DEFAULT_ORDERS),
                    help=f"which of {', '.join(o[0] for o in ALL_ORDERS)} to run (fcfs and one oracle needed; "
                         "ssjf_guard, an earlier name, runs ssjf)")
    ap.add_argument("--overtake-bound", type=float, default=qo.OVERTAKE_BOUND,
                    help="ssjf and + refine runs (not ssjf_noguard): the SizeRule overtake bound ε (0 = off)")
    ap.add_argument("--tail-guard", type=float, default=qo.TAIL_GUARD,
                    help="ssjf and + refine runs (not ssjf_noguard): the SizeRule tail guard quantile (0 = off, "
                         "the default; 0.7 was the live rule before the overtake bound)")
    ap.add_argument("--input-weight", type=float, default=-1.0,
                    help="ssjf: the prompt term's weight (-1 = core.queue_order's default)")
    ap.add_argument("--max-batch", type=int, default=0,
                    help="the worker's batch slots (0 = the simulator's default, 64); e.g. 4 for a small-batch engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="experiments-out/sjf")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    perf, raw = load_perf(args.profile)
    ctx, ctx_src = context_limit(raw)
    prof, prof_src = profiled_prompt_tokens(raw)
    global ORDERS
    want = {ALIASES.get(o, o) for o in args.orders.split(",")}
    ORDERS = tuple(o for o in ALL_ORDERS if o[0] in want)
    if "fcfs" not in want or not want & set(ORACLES) or want - {o[0] for o in ALL_ORDERS}:
        ap.error(f"--orders: names from {', '.join(o[0] for o in ALL_ORDERS)}, fcfs and an oracle among them")
    base = SimConfig(workers=1, context_limit=ctx, over_context="reject", profiled_prefill_tokens=prof, ssjf_window_factor=args.window_factor,
                     ssjf_input_weight=args.input_weight,
                     worker=WorkerConfig(kv_capacity=int(raw.get("kv_capacity_tokens", 0)),
                                         tp=int(raw.get("tensor_parallel", 1)), tail_guard=args.tail_guard,
                                         overtake_bound=args.overtake_bound,
                                         **({"max_batch": args.max_batch} if args.max_batch > 0 else {})))
    confusion, cname = resolve_confusion(args.confusion)
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    traces = [(t, 0) for t in args.trace] if args.trace else \
        [t for t in default_traces() if not args.only or any(k in t[0] for k in args.only.split(","))]
    rows: list[dict] = []
    for spec, c in traces:
        rows += run_trace(spec, c, perf, raw, base, loads, args.requests, confusion, cname, args.seed)
        print(table([r for r in rows if r["trace"] == rows[-1]["trace"]]).splitlines()[-1], flush=True)
    notes = [(f"SIMULATED. profile {raw.get('name')}; one worker, max batch {base.worker.max_batch}; "
              f"first {args.requests} requests per run; ssjf window factor "
              f"{args.window_factor or qo.WINDOW_FACTOR:g}, input weight "
              f"{args.input_weight if args.input_weight >= 0 else qo.INPUT_WEIGHT:g}; overtake bound "
              f"{f'{args.overtake_bound:g} of the completions of the last P99 JCT' if args.overtake_bound else 'off'}, "
              f"tail guard {f'P{100 * args.tail_guard:g} of recent JCT' if args.tail_guard else 'off'} "
              "(ssjf_noguard: both off); "
              f"+ refine: preempt quantum {qo.PREEMPT_QUANTUM} steps, margin {qo.PREEMPT_MARGIN:g} W, paused KV "
              f"kept, survival tables of {qo.REFINE_HISTORY} completions "
              f"(prior {qo.REFINE_PRIOR:g}, from {qo.REFINE_MIN_SAMPLES})"),
             "predictor model: " + "; ".join(dict.fromkeys(r["predictor"] for r in rows)),
             (f"context limit {ctx} tokens ({ctx_src}; prompts over it rejected) unless the trace line says "
              f"otherwise; profiled prompts up to {prof} tokens ({prof_src})")]
    for tr in dict.fromkeys(r["trace"] for r in rows):
        r = next(x for x in rows if x["trace"] == tr and x["order"] == "fcfs")
        c = r["counters"]
        notes.append(f"{tr}: saturation {r['saturation_rps']:.3f} req/s, context limit {r['context_limit']}, "
                     f"rejected over context {c.get('over_context_rejected', 0)}, outputs capped "
                     f"{c.get('output_capped', 0)}, PREFILL EXTRAPOLATED beyond the profiled range for "
                     f"{c.get('prefill_extrapolated', 0)} of {r['requests']} (load {r['load']:g})")
    text = table(rows) + "\n\n" + "\n".join(notes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"simulated": True, "command": "python -m "
                                                  "polyserve.simulator.sjf_experiment " + " ".join(argv or []),
                                                  "rows": rows}, indent=1, default=str) + "\n")
    (out / "results.txt").write_text(text + "\n")
    print("\n" + text + f"\n\nresults: {out}/results.json ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
