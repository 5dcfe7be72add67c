"""`polyserve bench sjf-live`: the worker's queue orders on a live `hf` engine, not the simulator.

One `hf` engine (CPU, a random Llama of `--arch`'s size: real batching, KV and pauses, not a
real model's speed or outputs) serves the same open-loop workload once per order: output lengths
drawn from a trace (default: the Azure LLM 2023 code trace), scaled so its p99 is
`--max-tokens` and forced (`min_tokens` = `max_tokens` = the length, greedy); predictions drawn
from the shipped predictor's measured out-of-distribution confusion (as the simulator's
`--predictor confusion`); Poisson arrivals at each `--loads` fraction of the engine's measured
capacity (all requests queued at once under FCFS: requests / makespan). Orders: `fcfs`, `ssjf`,
`ssjf_refine` (with its pauses) and `oracle` (shortest true length first, non-preemptive; what
SSJF is measured against, µ-Serve §4.3). Each run is a process of its own: the live rules keep
what they learned in module state (`core.queue_order`), and a run must not inherit another's.

    polyserve bench sjf-live [--requests 200] [--loads 0.8 1.0] [--max-batch 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from polyserve.shared.paths import datasets_dir

ORDERS = ("fcfs", "ssjf", "ssjf_refine", "oracle")
TRACE = datasets_dir() / "traces" / "azure_llm_2023_code.csv"
ARCH = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=str(TRACE), help="CSV with a GeneratedTokens column (output lengths)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0],
                    help="arrival rate as a fraction of the engine's measured capacity")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128, help="the trace's p99 output length maps to this")
    ap.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    ap.add_argument("--arch", default=json.dumps(ARCH),
                    help="the random Llama's size (JSON, hf_model.RANDOM_ARCH keys): big enough that a decode step, "
                         "not the queue's upkeep, takes the time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one order in this process


def workload(args: argparse.Namespace) -> dict:
    """Lengths, predictions and unit-rate Poisson gaps of `args.requests` requests."""
    import csv

    from polyserve.simulator.predictor import LengthPredictor, resolve_confusion

    with open(args.trace, newline="") as f:
        lengths = np.array([int(r["GeneratedTokens"]) for r in csv.DictReader(f)], dtype=np.float64)
    rng = np.random.default_rng(args.seed)
    drawn = rng.choice(lengths, size=args.requests)
    scale = args.max_tokens / max(1.0, float(np.percentile(lengths, 99)))
    out = np.clip(np.round(drawn * scale), 1, args.max_tokens).astype(np.int64)
    confusion, name = resolve_confusion(None)
    tokens, classes = LengthPredictor("confusion", out, confusion=confusion, seed=args.seed).precompute(out)
    gaps = rng.exponential(1.0, size=args.requests)
    return {"lengths": out.tolist(), "predicted": tokens.tolist(), "classes": classes.tolist(),
            "gaps": gaps.tolist(), "predictor": name, "max_batch": args.max_batch, "arch": json.loads(args.arch)}


async def _serve(spec: dict) -> list[float]:
    """One order over the workload; JCT (s) per request, in request order."""
    import types

    from polyserve.proto import SamplingParams
    from polyserve.worker.engine import EngineRequest, Finished
    from polyserve.worker.engines.hf import HfEngine

    order = spec["order"]
    settings = types.SimpleNamespace(model="tiny-random", model_path="", device="cpu", dtype="float32",
                                     max_waiting=10_000, max_batch=spec["max_batch"], kv_capacity_tokens=1 << 22,
                                     max_input_len=512, scheduling="fcfs" if order == "oracle" else order,
                                     random_arch=spec["arch"])
    engine = HfEngine(settings, order=(lambda r: r.params.max_tokens) if order == "oracle" else None)
    await engine.start()
    jct: list[float] = [0.0] * len(spec["lengths"])

    async def one(i: int, arrival: float) -> None:
        n = spec["lengths"][i]
        req = EngineRequest(f"r{i}", f"request {i}: tell me something", SamplingParams(
            max_tokens=n, min_tokens=n, temperature=0), predicted_tokens=spec["predicted"][i],
            length_class=spec["classes"][i])
        async for ev in engine.generate(req):
            if isinstance(ev, Finished):
                jct[i] = time.monotonic() - arrival

    tasks, t0 = [], time.monotonic()
    at = 0.0
    for i, gap in enumerate(spec["gaps"]):
        at += gap * spec["mean_gap_s"]
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, time.monotonic())))
    await asyncio.gather(*tasks)
    await engine.stop()
    return jct


def _run(spec: dict) -> list[float]:
    """`_serve` in a fresh process (module state of the live rules starts empty)."""
    proc = subprocess.run([sys.executable, "-m", "polyserve.bench.sjf_live", "--one", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"sjf-live run {spec['order']} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> int:
    if args.one:
        print(json.dumps(asyncio.run(_serve(json.loads(args.one)))))
        return 0
    if args.requests < 10 or args.max_batch < 1 or not all(0 < x <= 2 for x in args.loads):
        raise SystemExit("--requests must be >= 10, --max-batch >= 1, --loads within (0, 2]")
    if not Path(args.trace).exists():
        raise SystemExit(f"trace not found: {args.trace} (set --trace or POLYSERVE_DATASETS)")
    wl = workload(args)
    print(f"sjf-live: hf engine on CPU (small random Llama), {args.requests} requests, max_batch "
          f"{args.max_batch}, lengths from {Path(args.trace).name} scaled to p99 {args.max_tokens} "
          f"(mean {np.mean(wl['lengths']):.1f}); predictions: {wl['predictor']}", flush=True)
    t = time.monotonic()
    backlog = _run({**wl, "order": "fcfs", "mean_gap_s": 0.0})
    capacity = args.requests / max(backlog)
    print(f"capacity (all {args.requests} queued at once, fcfs): {capacity:.2f} requests/s "
          f"({time.monotonic() - t:.0f} s)", flush=True)
    rows = []
    for load in args.loads:
        for order in args.orders:
            jct = np.array(_run({**wl, "order": order, "mean_gap_s": 1.0 / (load * capacity)}))
            rows.append({"load": load, "order": order, "mean_s": float(jct.mean()),
                         "p99_s": float(np.percentile(jct, 99))})
            print(f"  load {load:.2f} {order:12s} mean JCT {rows[-1]['mean_s']:7.3f} s  P99 {rows[-1]['p99_s']:7.3f} s",
                  flush=True)
    print("\nload  order         mean JCT s  vs fcfs   share of oracle's cut   P99 s  P99 vs fcfs")
    for load in args.loads:
        by = {r["order"]: r for r in rows if r["load"] == load}
        base, best = by.get("fcfs"), by.get("oracle")
        for order, r in by.items():
            vs = r["mean_s"] / base["mean_s"] - 1 if base else float("nan")
            cut = base["mean_s"] - best["mean_s"] if base and best else 0.0
            share = (base["mean_s"] - r["mean_s"]) / cut if cut > 0 else float("nan")
            p99 = r["p99_s"] / base["p99_s"] if base else float("nan")
            print(f"{load:4.2f}  {order:12s} {r['mean_s']:10.3f}  {vs:+7.1%}   {share:20.0%}   {r['p99_s']:6.3f}  "
                  f"{p99:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"capacity_rps": capacity, "rows": rows, "predictor": wl["predictor"],
                                               "requests": args.requests, "max_batch": args.max_batch}, indent=2))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m polyserve.bench.sjf_live", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
