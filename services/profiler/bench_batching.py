"""`polyserve profile bench-batching`: what continuous batching buys on a real engine.

One engine instance (the `hf` engine in-process by default, the small random
Llama on CPU unless `--model-path`), one seeded workload, several ways of feeding
it, all in one run so the ratios compare like with like:

* sequential: one request at a time (the next is submitted when the last ends);
* static: batches of `c` requests; a batch is submitted together and the next
  batch only when every request of this one has finished. Built by gating
  submissions on top of the same engine, which frees a finished row at once,
  so this baseline is kinder than a padded static batch (no compute is spent on
  rows that already ended);
* continuous: `c` closed-loop clients; each submits its next request as soon
  as its previous one ends, and the engine admits it between decode steps;
* mixed adapters: continuous, requests spread round-robin over two random
  LoRA adapters and the base model, against base-only requests on the same
  PEFT-wrapped model and on the plain model.

`--kv-layout padded,ragged` runs every mode on one engine per KV layout (same
seeded model), interleaved, so the layouts compare under the same load; each row
also reports the KV cells (row x column, padding included) that decode steps
attended over per output token.

Output lengths are drawn (seeded) from `GeneratedTokens` of the Azure LLM 2023
conversation trace and capped (default 256: a third of the trace is longer);
input lengths from `ContextTokens`, capped small (default 128, which most rows
exceed). Every request is greedy with min_tokens = max_tokens = its drawn
length, so it generates exactly that many tokens. Throughput = output tokens
/ wall time from the first submission to the last completion.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
import types
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

from polyserve.profiler.grid import PromptMaker
from polyserve.proto import SamplingParams
from polyserve.shared.paths import datasets_dir
from polyserve.worker.engine import Delta, EngineRequest

DEFAULT_TRACE = datasets_dir() / "traces" / "azure_llm_2023_conv.csv"


def draw_lengths(trace: str | Path, n: int, seed: int, out_cap: int, in_cap: int) -> list[tuple[int, int]]:
    """`n` (input, output) token lengths drawn without replacement (seeded) from the trace, capped."""
    with open(trace, newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    picked = random.Random(seed).sample(rows, min(n, len(rows)))
    return [(max(1, min(ctx, in_cap)), max(1, min(gen, out_cap))) for ctx, gen in picked]


class Runner:
    """Feeds one engine a list of (prompt, input tokens, output tokens) in the ways above."""

    def __init__(self, engine):
        self.engine = engine
        self._ids = itertools.count()

    async def one(self, prompt: str, out: int, adapter: str | None = None) -> int:
        params = SamplingParams(max_tokens=out, min_tokens=out, temperature=0.0)
        req = EngineRequest(f"bench-{next(self._ids)}", prompt, params, adapter=adapter)
        tokens = 0
        async for ev in self.engine.generate(req):
            if isinstance(ev, Delta):
                tokens += ev.tokens
        return tokens

    async def run(self, items: list[tuple[str, int, int]], mode: str, c: int,
                  adapters: list[str | None] | None = None) -> dict:
        """Throughput of `items` fed as `mode` (sequential | static | continuous) at concurrency `c`."""
        names = adapters or [None]
        jobs = [(p, out, names[i % len(names)]) for i, (p, _, out) in enumerate(items)]
        batch = getattr(self.engine, "_batch", None)
        cells0 = getattr(batch, "cells", 0)
        t0, cpu0 = time.perf_counter(), time.process_time()
        if mode == "sequential":
            tokens = [await self.one(*j) for j in jobs]
        elif mode == "static":
            tokens = []
            for i in range(0, len(jobs), c):
                tokens += await asyncio.gather(*(self.one(*j) for j in jobs[i:i + c]))
        elif mode == "continuous":
            queue, tokens = deque(jobs), []

            async def client():
                while queue:
                    tokens.append(await self.one(*queue.popleft()))

            await asyncio.gather(*(client() for _ in range(min(c, len(jobs)))))
        else:
            raise ValueError(f"unknown mode {mode!r}")
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        total = sum(tokens)
        # cpu_s / wall_s well below the torch thread count means other processes took the cores
        # KV cells (row x column, padding included) the decode steps attended over, per output token
        cells = getattr(batch, "cells", 0) - cells0
        return {"mode": mode, "requests": len(jobs), "tokens": total, "wall_s": round(wall, 4), "cpu_s": round(cpu, 3),
                "tok_s": round(total / wall, 2), "kv_cells_per_token": round(cells / max(total, 1), 1)}


def _hf_engine(args, kv_layout: str = "auto"):
    from polyserve.worker.engines.hf import HfEngine
    levels = [int(c) for c in args.concurrency.split(",")]
    settings = types.SimpleNamespace(
        model=args.model or ("" if args.model_path else "tiny-llama-random"), model_path=args.model_path,
        device=args.device, dtype=args.dtype, max_batch=max(levels), max_waiting=1024,
        kv_capacity_tokens=0, max_input_len=max(4096, args.input_cap + 8), seed=args.seed, kv_layout=kv_layout)
    return HfEngine(settings)


async def bench(args) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    layouts = list(dict.fromkeys(args.kv_layout.split(",")))
    sizes = {c: max(args.min_requests, args.per_slot * c) for c in levels}
    lengths = draw_lengths(args.trace, max(sizes.values()), args.seed, args.output_cap, args.input_cap)
    engines = {layout: _hf_engine(args, layout) for layout in layouts}  # same seed: the same model in each
    load_before = os.getloadavg()
    say = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        for engine in engines.values():
            await engine.start()
        first = next(iter(engines.values()))
        maker = PromptMaker(first.count_tokens, args.seed)
        made = [maker.make(l_in) for l_in, _ in lengths]
        items = [(p, n_in, out) for (p, n_in), (_, out) in zip(made, lengths)]
        runners = {layout: Runner(engine) for layout, engine in engines.items()}
        for runner in runners.values():
            await runner.run(items[:4], "continuous", 4)  # warm-up
        rows = []
        for c in levels:
            work = items[:sizes[c]]
            plan = [(f"{lay}|{m}", runners[lay], m, None) for m in MODES for lay in layouts]
            best = await _rounds(work, c, plan, args.rounds, say)
            rows += [{"kv_layout": engines[lay]._batch.layout, "concurrency": c, "requests": len(work),
                      "output_tokens": sum(o for *_, o in work), **{m: best[f"{lay}|{m}"] for m in MODES}}
                     for lay in layouts]
        if not args.no_adapters:
            adapters = {lay: await _load_two_adapters(e, args, say) for lay, e in engines.items()}
            for c in levels:
                work = items[:sizes[c]]
                plan = [(f"{lay}|{key}", runners[lay], "continuous", names) for lay in layouts
                        for key, names in (("base_peft", [None]), ("mixed", [*adapters[lay][:2], None]))]
                best = await _rounds(work, c, plan, args.rounds, say)
                for row, lay in zip([r for r in rows if r["concurrency"] == c], layouts):
                    row.update(base_peft=best[f"{lay}|base_peft"], mixed=best[f"{lay}|mixed"])
        for row in rows:
            cont = row["continuous"]["tok_s"]
            cpu = {m: row[m]["tokens"] / max(row[m]["cpu_s"], 1e-9) for m in MODES}  # tokens per CPU-second
            row["ratios"] = {"continuous/sequential": round(cont / row["sequential"]["tok_s"], 3),
                             "continuous/static": round(cont / row["static"]["tok_s"], 3),
                             "cpu continuous/sequential": round(cpu["continuous"] / cpu["sequential"], 3),
                             "cpu continuous/static": round(cpu["continuous"] / cpu["static"], 3)}
            if "mixed" in row:
                row["ratios"].update({"mixed/base_peft": round(row["mixed"]["tok_s"] / row["base_peft"]["tok_s"], 3),
                                      "mixed/base_plain": round(row["mixed"]["tok_s"] / cont, 3)})
        card = first.model_card()
    finally:
        for engine in engines.values():
            await engine.stop()
    outs = [o for _, o in lengths]
    return {
        "benchmark": "continuous vs static vs one-at-a-time batching; mixed-adapter batches vs base-only",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "engine": "hf", "model": card.get("model"), "model_source": card.get("source"),
        "device": card.get("device"), "dtype": card.get("dtype"), "host": platform.processor() or platform.machine(),
        "workload": {"trace": Path(args.trace).name, "seed": args.seed, "output_cap": args.output_cap,
                     "input_cap": args.input_cap, "requests_per_level": sizes,
                     "mean_output_tokens": round(sum(outs) / len(outs), 1),
                     "outputs_at_cap": sum(o == args.output_cap for o in outs), "drawn": len(outs),
                     "adapters": None if args.no_adapters else {
                         "ranks": args.adapter_ranks, "mix": "round-robin over two adapters and the base model"}},
        "loadavg_before": [round(v, 2) for v in load_before], "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "rows": rows,
    }


MODES = ("sequential", "static", "continuous")


async def _rounds(work, c: int, plan, rounds: int, say) -> dict[str, dict]:
    """Run every (key, runner, mode, adapters) of `plan` `rounds` times, interleaved; keep each key's fastest."""
    best: dict[str, dict] = {}
    for _ in range(max(1, rounds)):
        for key, runner, mode, names in plan:
            r = await runner.run(work, mode, c, names)
            say(_line(c, key, r))
            if key not in best or r["tok_s"] > best[key]["tok_s"]:
                best[key] = {**r, "rounds": [*best.get(key, {}).get("rounds", []), r["tok_s"]]}
            else:
                best[key]["rounds"].append(r["tok_s"])
    return best


def _line(c: int, mode: str, r: dict) -> str:
    return (f"c={c:<3} {mode:<18} {r['tokens']:6d} tokens in {r['wall_s']:7.2f} s = {r['tok_s']:8.1f} tok/s "
            f"(process cpu {r['cpu_s'] / r['wall_s']:.2f} cores; {r['kv_cells_per_token']:.0f} KV cells/token)")


async def _load_two_adapters(engine, args, say) -> list[str]:
    from polyserve.worker.lora import create_random_adapter
    tmp = Path(tempfile.mkdtemp(prefix="polyserve-bench-"))
    names = []
    for i, rank in enumerate(int(r) for r in args.adapter_ranks.split(",")[:2]):
        name = f"bench-r{rank}-{i}"
        path = await asyncio.to_thread(create_random_adapter, args.model_path or "random", rank, tmp / name, seed=i)
        await engine.load_adapter(name, str(path))
        names.append(name)
        say(f"loaded random adapter {name} (rank {rank})")
    return names


def table(result: dict) -> str:
    """The result as a plain-text table (tokens/s and ratios side by side)."""
    adapters = all("mixed" in r for r in result["rows"])
    head = ("kv", "c", "reqs", "out tok", "seq tok/s", "static tok/s", "cont tok/s", "cont/seq", "cont/static",
            "cpu cont/seq", "cpu cont/static", "cells/tok static", "cells/tok cont")
    if adapters:
        head += ("base+peft tok/s", "mixed tok/s", "mixed/base+peft", "mixed/base")
    lines = [head]
    for r in result["rows"]:
        q = r["ratios"]
        line = (r["kv_layout"], str(r["concurrency"]), str(r["requests"]), str(r["output_tokens"]),
                f"{r['sequential']['tok_s']:.1f}", f"{r['static']['tok_s']:.1f}", f"{r['continuous']['tok_s']:.1f}",
                f"{q['continuous/sequential']:.2f}x", f"{q['continuous/static']:.2f}x",
                f"{q['cpu continuous/sequential']:.2f}x", f"{q['cpu continuous/static']:.2f}x",
                f"{r['static']['kv_cells_per_token']:.0f}", f"{r['continuous']['kv_cells_per_token']:.0f}")
        if adapters:
            line += (f"{r['base_peft']['tok_s']:.1f}", f"{r['mixed']['tok_s']:.1f}", f"{q['mixed/base_peft']:.2f}x",
                     f"{q['mixed/base_plain']:.2f}x")
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-path", default="", help="local HF checkpoint (default: the small random Llama)")
    ap.add_argument("--model", default="", help="model name to report")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated concurrency levels")
    ap.add_argument("--per-slot", type=int, default=2, help="requests per level = max(min-requests, per-slot x c)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--output-cap", type=int, default=256, help="cap on drawn GeneratedTokens")
    ap.add_argument("--input-cap", type=int, default=128, help="cap on drawn ContextTokens")
    ap.add_argument("--adapter-ranks", default="8,16", help="ranks of the two random adapters")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; each mode keeps its best")
    ap.add_argument("--kv-layout", default="auto",
                    help="KV layout(s) of the hf engine, comma-separated to compare in one run: auto (ragged on "
                         "CPU, padded on CUDA), ragged, padded")
    ap.add_argument("--no-adapters", action="store_true", help="skip the mixed-adapter runs")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0 = torch's default); 1 makes tokens per CPU-second a steadier "
                         "figure on a machine shared with other jobs")
    ap.add_argument("--json", default="", help="also write the result as JSON here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="polyserve profile bench-batching", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    bad = [lay for lay in args.kv_layout.split(",") if lay not in ("auto", "ragged", "padded")]
    if bad:
        ap.error(f"--kv-layout {','.join(bad)}: choose from auto, ragged, padded (comma-separated)")
    _quiet_transformers()
    from polyserve.worker.engines.hf_model import resolve_device
    try:  # say what is wrong before loading anything
        resolve_device(args.device)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"polyserve profile bench-batching: --device {args.device}: {exc}") from None
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)
    result = asyncio.run(bench(args))
    result["command"] = "polyserve profile bench-batching " + shlex.join(argv)
    print(f"# {result['command']}")
    print(f"# hf engine, {result['model']} ({result['model_source']}) on {result['device']} {result['dtype']}; "
          f"outputs from {result['workload']['trace']} capped at {args.output_cap} "
          f"(mean {result['workload']['mean_output_tokens']}), inputs capped at {args.input_cap}; measured")
    print(table(result))
    print(f"# load average before/after: {result['loadavg_before']} / {result['loadavg_after']} "
          f"(other processes on this machine skew CPU timings); ratios: tokens/s of wall time, and "
          f"'cpu': tokens per CPU-second of this process (steadier when the cores are shared)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _quiet_transformers() -> None:
    """The fallback tokenizer warns about its 512-token BERT limit on longer prompts; the Llama does not care."""
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
