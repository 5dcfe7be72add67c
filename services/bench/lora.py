"""`polyserve bench lora`: time to first token of a LoRA request, cold vs cached (CaraServe §4, §7.2).

For each adapter rank, the same request (a `--prompt-tokens` prompt, greedy, one output
token) runs through the `hf` engine in three states of its adapter:

* ``cached``: the adapter is already on the device (installed in the PEFT model);
* ``cold_on_demand``: the adapter is only in host memory; the request waits for the
  host -> device copy (and its install in the PEFT model), then prefills;
* ``cold_cpu_assisted``: the adapter is only in host memory; the prefill starts at once
  with the LoRA delta x·A·B computed on the CPU from the host copy while the copy runs
  in the background (the base model's x·W runs on the device);
* ``cold_on_demand_peft``: as ``cold_on_demand`` with the engine's slot reuse off
  (`hf_slots`): the eviction deletes the adapter's PEFT modules and the install is PEFT's
  own, as before slots; in the other cold states the eviction parks the modules and the
  install copies into them.

TTFT is the engine's own figure (first token time - arrival, `RequestStats.ttft_ms`).
States are interleaved per trial; the median and the spread over `--trials` are shown.
It runs on CUDA when there is one (the device is named) and on the CPU otherwise, where
the "device copy" is a clone in host memory (columns `copy` and `install`: medians of the
device copy and of PEFT's install of a landed copy, over the cold runs): cold-on-demand then costs only the clone
and PEFT's install, so the CPU figures show the mechanism's overheads, not a PCIe copy.
`--sim-link-gb-s X` adds the time a host -> device link of X GB/s would take to every
device copy (a sleep in the copy thread); figures made with it are labelled SIMULATED.

    polyserve bench lora --ranks 8,16,32,64 --trials 5 --json /tmp/bench-lora.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

from polyserve.shared import machine

STATES = ("cached", "cold_cpu_assisted", "cold_on_demand", "cold_on_demand_peft")
CPU_ARCH = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8)
CUDA_ARCH = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16)


def _say(line: str = "") -> None:
    print(line, flush=True)


def device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {machine.line()}, {torch.get_num_threads()} torch threads"


async def _ttft(eng, rid: str, prompt: str, adapter: str | None) -> float:
    from polyserve.proto import SamplingParams
    from polyserve.worker.engine import EngineRequest, Finished
    stats = None
    async for ev in eng.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0),
                                               adapter=adapter)):
        if isinstance(ev, Finished):
            stats = ev.stats
    return stats.ttft_ms


async def _one(eng, rid: str, prompt: str, name: str, state: str) -> float:
    eng._batch.slots.reuse = state != "cold_on_demand_peft"
    try:
        if state == "cached":
            await eng.ensure_on_device(name)
        else:
            await eng.demote_adapter(name)
            eng.cold_start = "cpu_assisted" if state == "cold_cpu_assisted" else "on_demand"
        ms = await _ttft(eng, rid, prompt, name)
        await eng.ensure_on_device(name)  # let a cold copy land before the next measurement
    finally:
        eng._batch.slots.reuse = True
    if state != "cached":
        copies.setdefault((name, state), []).append((eng.lora_stats["last_copy_ms"],
                                                     eng.lora_stats["last_install_ms"]))
    return ms


copies: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (adapter, state) -> (copy ms, install ms) per cold run


async def run(args) -> dict:
    import torch

    from polyserve.worker.engines.hf import HfEngine
    from polyserve.worker.lora import create_random_adapter

    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = [int(r) for r in args.ranks.split(",") if r]
    targets = tuple(t for t in args.targets.split(",") if t)
    cuda = args.device in ("auto", "cuda") and torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    arch = json.loads(args.arch) if args.arch else (CUDA_ARCH if cuda else CPU_ARCH)
    settings = types.SimpleNamespace(model="bench-lora", model_path=args.model_path or "",
                                     device="cuda" if cuda else "cpu", dtype=args.dtype, max_waiting=8,
                                     max_batch=4, kv_capacity_tokens=1 << 16, max_input_len=4096,
                                     random_arch=None if args.model_path else arch,
                                     lora_device_slots=len(ranks) + 1, lora_host_slots=len(ranks) + 1,
                                     lora_prefetch=False)
    eng = HfEngine(settings)
    await eng.start()
    eng._sim_link_gb_s = args.sim_link_gb_s
    dev = eng._bundle.device
    words = max(1, args.prompt_tokens - 1)
    prompt = " ".join(["serving"] * words)
    while eng.count_tokens(prompt) > args.prompt_tokens and words > 1:
        words -= 1
        prompt = " ".join(["serving"] * words)
    result: dict = {"device": device_name(dev), "simulated_link_gb_s": args.sim_link_gb_s or None,
                    "model": eng.model_card().get("source"), "arch": None if args.model_path else arch,
                    "dtype": str(eng._bundle.dtype).removeprefix("torch."), "targets": list(targets),
                    "prompt_tokens": eng.count_tokens(prompt), "trials": args.trials,
                    "torch": torch.__version__, "loadavg_start": os.getloadavg(), "ranks": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
            for r in ranks:
                path = create_random_adapter(eng._batch.model, r, Path(tmp) / f"r{r}", seed=r, targets=targets)
                await eng.load_adapter(f"r{r}", str(path), wait=True)
            base = [await _ttft(eng, f"warm-base-{i}", prompt, None) for i in range(2)]
            for r in ranks:  # warm every path once per rank
                for state in STATES:
                    await _one(eng, f"warm-{r}-{state}", prompt, f"r{r}", state)
            result["base_ttft_ms"] = statistics.median(
                [await _ttft(eng, f"base-{i}", prompt, None) for i in range(args.trials)] + base)
            for r in ranks:
                name = f"r{r}"
                samples: dict[str, list[float]] = {s: [] for s in STATES}
                for t in range(args.trials):
                    for state in STATES:
                        samples[state].append(await _one(eng, f"{name}-{state}-{t}", prompt, name, state))
                host = eng._loras[name].host
                cp = copies.get((name, "cold_on_demand"), [])[-args.trials:]
                peft = copies.get((name, "cold_on_demand_peft"), [])[-args.trials:]
                result["ranks"][r] = {"adapter_mb": round(host.nbytes / (1 << 20), 3),
                                      "copy_ms": statistics.median(c for c, _ in cp),
                                      "install_ms": statistics.median(i for _, i in cp),
                                      "install_peft_ms": statistics.median(i for _, i in peft),
                                      **{s: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                                             "samples_ms": [round(x, 3) for x in v]} for s, v in samples.items()}}
            result["lora_stats"] = dict(eng.lora_stats)
    finally:
        await eng.stop()
    result["loadavg_end"] = os.getloadavg()
    return result


def render(result: dict) -> str:
    sim = result["simulated_link_gb_s"]
    lines = [f"bench lora on {result['device']}" + (f"  [SIMULATED host->device link: {sim} GB/s]" if sim else ""),
             f"model {result['model']} {result['arch'] or ''} {result['dtype']}, targets {','.join(result['targets'])}, "
             f"prompt {result['prompt_tokens']} tokens, {result['trials']} trials, TTFT medians in ms "
             f"(base model without adapter: {result['base_ttft_ms']:.1f} ms)",
             "(on-demand: the install copies into the evicted adapter's kept modules; PEFT: PEFT's own install)",
             f"{'rank':>5} {'MB':>7} {'cached':>9} {'cpu-assist':>11} {'on-demand':>10} {'PEFT':>8} "
             f"{'cpu/cached':>11} {'on-dem/cached':>14} {'PEFT/cached':>12} {'copy':>7} {'install':>8} "
             f"{'PEFT inst':>10}"]
    for r, row in result["ranks"].items():
        c, a, o, p = (row[s]["median_ms"] for s in STATES)
        lines.append(f"{r:>5} {row['adapter_mb']:>7.2f} {c:>9.1f} {a:>11.1f} {o:>10.1f} {p:>8.1f} {a / c:>11.2f} "
                     f"{o / c:>14.2f} {p / c:>12.2f} {row['copy_ms']:>7.1f} {row['install_ms']:>8.1f} "
                     f"{row['install_peft_ms']:>10.1f}")
    lines.append(f"load average: start {tuple(round(x, 2) for x in result['loadavg_start'])}, "
                 f"end {tuple(round(x, 2) for x in result['loadavg_end'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="polyserve bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,16,32,64", help="comma-separated adapter ranks")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="modules the adapters target")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--model-path", default="", help="a local checkpoint instead of the random Llama")
    p.add_argument("--arch", default="", help="random Llama shape as JSON (default depends on the device)")
    p.add_argument("--sim-link-gb-s", type=float, default=0.0,
                   help="emulate a host->device link of this many GB/s (SIMULATED; 0 = off)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    if args.trials < 1 or args.prompt_tokens < 2:
        p.error("--trials must be >= 1 and --prompt-tokens >= 2")
    try:
        if not all(int(r) > 0 for r in args.ranks.split(",")):
            raise ValueError
    except ValueError:
        p.error(f"--ranks must be comma-separated positive integers, got {args.ranks!r}")
    if args.arch:
        try:
            if not isinstance(json.loads(args.arch), dict):
                raise ValueError
        except ValueError:
            p.error('--arch must be a JSON object, e.g. \'{"hidden_size": 1024, "num_hidden_layers": 8}\'')
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    result = asyncio.run(run(args))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    _say(render(result))
    _say(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
