"""`polyserve bench sjf-live`: the worker's queue orders on a live `hf` engine, not the simulator.

One `hf` engine (CPU, a random Llama of `--arch`'s size: real batching, KV and pauses, not a
real model's speed or outputs) serves the same open-loop workload once per order: output lengths
drawn from a trace (default: the Azure LLM 2023 code trace), scaled so its p99 is
`--max-tokens` and forced (`min_tokens` = `max_tokens` = the length, greedy); predictions drawn
from the shipped predictor's measured out-of-distribution confusion (as the simulator's
`--predictor confusion`); Poisson arrivals at each `--loads` fraction of the engine's measured
capacity (all requests queued at once under FCFS, the middle 80% of the completions). Orders: `fcfs`, `ssjf`,
`ssjf_refine` (with its pauses) and `oracle` (shortest true length first, non-preemptive; what
SSJF is measured against, µ-Serve §4.3); `ssjf_true` is the ssjf rule fed the true length as
its prediction (what the rule earns with a perfect predictor; the rest of ssjf's gap is the
predictor's). Each run is a process of its own: the live rules keep what they learned in module
state (`core.queue_order`), and a run must not inherit another's (forked from a forkserver that
imported torch once: `_context`).

One run per cell is not a measurement near saturation: the same seed and order gave mean JCTs
1.66 s and 2.18 s in two runs at load 1.0 (the queue's length random-walks there, and which long
requests share the 4 slots depends on timing), so `--repeats R` runs R workloads (seeds `--seed`,
`--seed`+1, ...; each with its own capacity measurement; the orders rotated between repeats) and
reports per cell the mean over repeats, the share of the oracle's cut from those means with the
range of the per-repeat shares, and P99 over all repeats' requests pooled.

    polyserve bench sjf-live [--requests 200] [--loads 0.8 1.0] [--repeats 1] [--max-batch 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from polyserve.shared.paths import datasets_dir

ORDERS = ("fcfs", "ssjf", "ssjf_refine", "oracle", "ssjf_true")
DEFAULT_ORDERS = ORDERS[:4]
TRACE = datasets_dir() / "traces" / "azure_llm_2023_code.csv"
ARCH = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=str(TRACE), help="CSV with a GeneratedTokens column (output lengths)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0],
                    help="arrival rate as a fraction of the engine's measured capacity")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128, help="the trace's p99 output length maps to this")
    ap.add_argument("--orders", nargs="+", default=list(DEFAULT_ORDERS), choices=ORDERS)
    ap.add_argument("--repeats", type=int, default=1, help="workloads (seeds) per cell; see the module doc")
    ap.add_argument("--arch", default=json.dumps(ARCH),
                    help="the random Llama's size (JSON, hf_model.RANDOM_ARCH keys): big enough that a decode step, "
                         "not the queue's upkeep, takes the time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")


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
    true_tokens, true_classes = LengthPredictor("oracle", out, confusion=confusion).precompute(out)
    gaps = rng.exponential(1.0, size=args.requests)
    return {"lengths": out.tolist(), "predicted": tokens.tolist(), "classes": classes.tolist(),
            "true_classes": true_classes.tolist(), "gaps": gaps.tolist(), "predictor": name,
            "max_batch": args.max_batch, "arch": json.loads(args.arch)}


async def _serve(spec: dict) -> list[float]:
    """One order over the workload; JCT (s) per request, in request order."""
    import types

    from polyserve.proto import SamplingParams
    from polyserve.worker.engine import EngineRequest, Finished
    from polyserve.worker.engines.hf import HfEngine

    order = spec["order"]
    if order == "ssjf_true":  # the ssjf rule with a perfect predictor
        order, spec = "ssjf", {**spec, "predicted": spec["lengths"], "classes": spec["true_classes"]}
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


def _child(spec: dict, conn) -> None:
    """One run in a process forked from the forkserver (see `_run`); its JCTs, or the error,
    through `conn`."""
    try:
        conn.send(("ok", asyncio.run(_serve(spec))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the bench
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


_CTX: Any = None


def _context() -> Any:
    """A forkserver that has imported torch, transformers and the hf engine once: every run is
    a fresh process forked from it (module state of the live rules as imported: empty), without
    the ~4.7 s of imports a new interpreter pays per run on a 2-core AVX2 machine. The server
    only imports: it never runs an engine, so no torch thread pool exists when it forks."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["numpy", "torch", "transformers", "polyserve.worker.engines.hf"])
    return _CTX


def _run(spec: dict) -> list[float]:
    """`_serve` in a fresh process (module state of the live rules starts empty)."""
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, send), name=f"sjf-live {spec['order']}")
    proc.start()
    send.close()
    try:
        status, value = recv.recv()
    except EOFError:  # it died without an answer (killed, out of memory)
        status, value = "error", ""
    finally:
        recv.close()
    proc.join()
    if status != "ok":
        raise SystemExit(f"sjf-live run {spec['order']} failed (exit code {proc.exitcode}):\n{value[-2000:]}")
    return value


def _capacity(wl: dict) -> float:
    """Requests/s of the engine with every request queued at once (FCFS), over the middle 80% of
    the completions: requests / makespan counted the run's start-up and its drain, where the last
    long requests run alone in a batch of one, and moved by a third between repeats of similar
    workloads (13.4 and 18.2 requests/s)."""
    done = np.sort(np.asarray(_run({**wl, "order": "fcfs", "mean_gap_s": 0.0})))
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done)) - 1
    span = done[hi] - done[lo]
    return (hi - lo) / span if span > 0 else len(done) / max(float(done[-1]), 1e-9)


def summarise(runs: list[dict], loads: list[float], orders: list[str]) -> list[dict]:
    """Per (load, order) over the repeats: mean JCT (mean of the repeats' means), the share of the
    oracle's cut from those means and the range of the per-repeat shares, P99 of every repeat's
    requests pooled, and P99 against FCFS's pooled P99."""
    out = []
    for load in loads:
        cell = {o: [r for r in runs if r["load"] == load and r["order"] == o] for o in orders}
        mean = {o: float(np.mean([r["mean_s"] for r in rs])) for o, rs in cell.items() if rs}
        p99 = {o: float(np.percentile(np.concatenate([r["jct"] for r in rs]), 99)) for o, rs in cell.items() if rs}
        for o in orders:
            if o not in mean:
                continue
            row = {"load": load, "order": o, "repeats": len(cell[o]), "mean_s": mean[o], "p99_s": p99[o],
                   "vs_fcfs": mean[o] / mean["fcfs"] - 1 if "fcfs" in mean else None,
                   "p99_vs_fcfs": p99[o] / p99["fcfs"] if "fcfs" in p99 else None, "share": None,
                   "share_min": None, "share_max": None}
            if "fcfs" in mean and "oracle" in mean and mean["fcfs"] > mean["oracle"]:
                row["share"] = (mean["fcfs"] - mean[o]) / (mean["fcfs"] - mean["oracle"])
                per = [(f["mean_s"] - r["mean_s"]) / (f["mean_s"] - b["mean_s"])
                       for r, f, b in zip(cell[o], cell["fcfs"], cell["oracle"]) if f["mean_s"] > b["mean_s"]]
                if per:
                    row["share_min"], row["share_max"] = min(per), max(per)
            out.append(row)
    return out


def _pct(x: float | None, fmt: str = "{:+.1%}") -> str:
    return "n/a" if x is None else fmt.format(x)


def main(args: argparse.Namespace) -> int:
    if args.requests < 10 or args.max_batch < 1 or args.repeats < 1 or not all(0 < x <= 2 for x in args.loads):
        raise SystemExit("--requests must be >= 10, --max-batch >= 1, --repeats >= 1, --loads within (0, 2]")
    if not Path(args.trace).exists():
        raise SystemExit(f"trace not found: {args.trace} (set --trace or POLYSERVE_DATASETS)")
    runs, capacities, t0 = [], [], time.monotonic()
    for k in range(args.repeats):
        wl = workload(argparse.Namespace(**{**vars(args), "seed": args.seed + k}))
        if k == 0:
            print(f"sjf-live: hf engine on CPU (small random Llama), {args.requests} requests x {args.repeats} "
                  f"repeat(s), max_batch {args.max_batch}, lengths from {Path(args.trace).name} scaled to p99 "
                  f"{args.max_tokens}; predictions: {wl['predictor']}", flush=True)
        capacities.append(_capacity(wl))
        print(f"repeat {k + 1}/{args.repeats} (seed {args.seed + k}, mean length {np.mean(wl['lengths']):.1f}): "
              f"capacity {capacities[-1]:.2f} requests/s (all queued at once, fcfs, middle 80% of the completions; "
              f"{time.monotonic() - t0:.0f} s)",
              flush=True)
        rotated = args.orders[k % len(args.orders):] + args.orders[:k % len(args.orders)]  # spread drift over orders
        for load in args.loads:
            for order in rotated:
                jct = np.array(_run({**wl, "order": order, "mean_gap_s": 1.0 / (load * capacities[-1])}))
                runs.append({"repeat": k, "seed": args.seed + k, "load": load, "order": order,
                             "mean_s": float(jct.mean()), "p99_s": float(np.percentile(jct, 99)), "jct": jct.tolist()})
                print(f"  load {load:.2f} {order:12s} mean JCT {runs[-1]['mean_s']:7.3f} s  P99 "
                      f"{runs[-1]['p99_s']:7.3f} s", flush=True)
    rows = summarise(runs, args.loads, args.orders)
    print(f"\nover {args.repeats} repeat(s): mean JCT = mean of the repeats' means; share of the oracle's cut from "
          "those means [range over repeats]; P99 of all requests pooled")
    print("load  order         mean JCT s  vs fcfs   share of oracle's cut        P99 s  P99 vs fcfs")
    for r in rows:
        rng = "" if r["share_min"] is None or args.repeats == 1 else \
            f" [{r['share_min']:.0%}, {r['share_max']:.0%}]"
        print(f"{r['load']:4.2f}  {r['order']:12s} {r['mean_s']:10.3f}  {_pct(r['vs_fcfs']):>7s}   "
              f"{_pct(r['share'], '{:.0%}') + rng:>26s}   {r['p99_s']:6.3f}  {_pct(r['p99_vs_fcfs'], '{:.2f}'):>10s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"capacity_rps": capacities, "rows": rows, "predictor": wl["predictor"],
                                               "requests": args.requests, "repeats": args.repeats,
                                               "max_batch": args.max_batch,
                                               "runs": runs},  # with each request's JCT: files merge
                                              indent=2))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m polyserve.bench.sjf_live", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
