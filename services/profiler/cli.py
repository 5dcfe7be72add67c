"""`polyserve profile ...`: profile an engine, fit its performance models, list profiles, benchmark batching.

    polyserve profile run --engine hf [--model-path DIR] --out FILE     measure a grid, fit, write a profile
    polyserve profile run --engine sim --profile P --time-scale 0.02 --out FILE   (replays a profile: simulated)
    polyserve profile fit-splitwise --out FILE                          GPU profile from the Splitwise CSV
    polyserve profile list [--dir DIR]                                  profiles with source and fit quality
    polyserve profile show FILE                                         one profile's fits
    polyserve profile bench-batching [--json FILE]                      continuous vs static vs sequential
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import types
from datetime import datetime, timezone
from pathlib import Path

from polyserve.core import profiles
from polyserve.core.profiles import profile_path
from polyserve.profiler import fit as fitmod
from polyserve.profiler.grid import GridRunner, GridSpec
from polyserve.shared import machine
from polyserve.shared.paths import datasets_dir

DATASETS = datasets_dir()
SPLITWISE = DATASETS / "profiles" / "splitwise_llama2_70b_bloom_176b_a100_h100.csv"
AZURE_CONV = DATASETS / "traces" / "azure_llm_2023_conv.csv"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
QUICK = GridSpec(prefill_lengths=(32, 256), prefill_counts=(1, 2), decode_batches=(1, 4, 8), decode_contexts=(64, 512),
                 decode_steps=10, lora_ranks=(4, 16), lora_batches=(2, 4), repeats=1, warmup=1)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- run
def _spec(args) -> GridSpec:
    base = QUICK if args.quick else GridSpec()
    over = {k: getattr(args, k) for k in ("prefill_lengths", "prefill_counts", "decode_batches", "decode_contexts",
                                          "lora_ranks", "lora_batches") if getattr(args, k) is not None}
    over = {k: _ints(v) for k, v in over.items()}
    if args.no_lora:
        over["lora_ranks"] = ()
    for k in ("decode_steps", "repeats", "seed"):
        if getattr(args, k) is not None:
            over[k] = getattr(args, k)
    return GridSpec(**{**base.as_dict(), **over}) if over else base


def _hf_engine(args, spec: GridSpec):
    from polyserve.worker.engines.hf import HfEngine
    settings = types.SimpleNamespace(
        model=args.model or ("" if args.model_path else "tiny-llama-random"), model_path=args.model_path,
        device=args.device, dtype=args.dtype, max_batch=max(spec.max_batch, 16), max_waiting=1024,
        kv_capacity_tokens=0, max_input_len=max(4096, spec.max_input + 8), seed=args.seed or 0,
        random_arch=args.random_arch or None,
        # a grid point's prompts must enter one engine iteration together, whatever their total size
        prefill_tokens_per_step=1 << 30)
    return HfEngine(settings)


def _hf_kv_bytes(args, card: dict) -> tuple[int, dict]:
    """KV bytes per token from the model config: 2 x layers x kv_heads x head_dim x dtype bytes."""
    if args.model_path:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(args.model_path)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    else:
        from polyserve.worker.engines.hf_model import random_config
        cfg = random_config(**(json.loads(args.random_arch) if args.random_arch else {}))
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = DTYPE_BYTES.get(card.get("dtype", "float32"), 4)
    dims = {"layers": cfg.num_hidden_layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype_bytes": elem,
            "hidden_size": cfg.hidden_size}
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem, dims


def _device_name(device: str) -> tuple[str, str]:
    """(short label, description) of where the engine ran."""
    if device.startswith("cuda"):
        import torch
        return "GPU", torch.cuda.get_device_name(torch.device(device))
    try:
        import torch
        threads = torch.get_num_threads()
    except ImportError:
        threads = os.cpu_count()
    return "CPU", f"{machine.line()}; {threads} torch threads"


async def _run_grid(args, spec: GridSpec):
    if args.engine == "hf":
        engine = _hf_engine(args, spec)
    else:
        from polyserve.worker.engines.sim import SimEngine, load_profile
        engine = SimEngine(load_profile(args.profile), model_name=args.model or "sim",
                           max_batch=max(spec.max_batch, 16), max_waiting=1024, time_scale=args.time_scale,
                           max_input_len=max(4096, spec.max_input * 2))
    await engine.start()
    try:
        runner = GridRunner(engine, spec, progress=None if args.quiet else _say,
                            adapter_base=args.model_path or "random")
        meas = await runner.run()
        return engine.model_card(), engine.load(), meas
    finally:
        await engine.stop()


def cmd_run(args, argv: list[str]) -> int:
    spec = _spec(args)
    load_before = os.getloadavg()
    if args.engine == "hf":
        _quiet_transformers()
    card, load, meas = asyncio.run(_run_grid(args, spec))
    raw = meas.as_dict()
    if args.engine == "hf":
        kv_bytes, dims = _hf_kv_bytes(args, card)
        where, device = _device_name(card.get("device", args.device))
        name = args.name or f"hf-{card.get('model', 'model')}-{card.get('device', args.device).split(':')[0]}"
        note = (f"measured on {where} ({device}) through the hf engine's generate(): wall-clock times as a client "
                f"of the Engine interface sees them; the sim engine may replay it (its output is then simulated)")
        simulated = False
    else:
        prof_raw = json.loads(Path(args.profile or profile_path(profiles.DEFAULT_SIM)).read_text())
        kv_bytes, dims = int(prof_raw.get("kv_bytes_per_token", 0)), {}
        where, device = "sim", f"sim engine replaying {card.get('profile')} at time_scale {args.time_scale}"
        if args.time_scale > 0:
            raw = fitmod.scale_times(raw, 1.0 / args.time_scale)
        name = args.name or f"sim-replay-{card.get('profile')}"
        note = "SIMULATED: the sim engine's modelled times (wall ms / time_scale), not a measurement of hardware"
        simulated = True
    source = _source(args, card, spec, meas, dims, where, device, load_before[0])
    median, sigma, out_src = _output_lengths(args.output_trace)
    prof = fitmod.build_profile(raw, name=name, source=source, kv_capacity_tokens=load.kv_capacity,
                                kv_bytes_per_token=kv_bytes, median_output_tokens=median, output_log_sigma=sigma,
                                output_length_source=out_src, note=note)
    prof["measured"], prof["simulated"] = not simulated, simulated
    prof["command"] = "polyserve profile " + shlex.join(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=2) + "\n")
    print(f"# {prof['command']}")
    print(f"# {name}: {note}")
    print(f"# grid: {len(raw['prefill'])} prefill, {len(raw['decode'])} decode, {len(raw['lora'])} LoRA points "
          f"in {meas.elapsed_s:.1f} s")
    for line in fitmod.summary_lines(prof["fit"]):
        print(line)
    for note_line in meas.notes:
        print(f"note: {note_line}")
    print(f"kv: {kv_bytes} B/token, capacity {load.kv_capacity} tokens -> {out}")
    return 0


def _source(args, card: dict, spec: GridSpec, meas, dims: dict, where: str, device: str, load_before: float) -> dict:
    """Where a measured profile came from: engine, model, device, date, grid, how it was timed."""
    return {"engine": args.engine, "model": card.get("model"), "model_source": card.get("source", ""),
            "architecture": card.get("architecture", ""), "parameters": card.get("parameters"),
            "dtype": card.get("dtype", ""), "model_dims": dims, "device": card.get("device", args.device),
            "device_name": device, "measured_on": where,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "grid": spec.as_dict(),
            "grid_seconds": round(meas.elapsed_s, 1), "untrained": bool(card.get("untrained", False)),
            "timing": ("prefill: submit n prompts with max_tokens=1 together, wall time until the last ends; "
                       "decode: median gap between Deltas while all b rows decode (min_tokens=max_tokens, greedy); "
                       "fastest of the repeats"),
            "versions": _versions(),
            # other processes on the host inflate CPU timings: the 1-minute load average before and after
            "loadavg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _output_lengths(trace: str) -> tuple[int, float, str]:
    from polyserve.core.profile_fit import AZURE_CONV_LOG_SIGMA, AZURE_CONV_MEDIAN, output_lengths
    if trace and Path(trace).is_file():
        median, sigma = output_lengths(trace)
        return median, sigma, f"median and log-sigma of GeneratedTokens in {Path(trace).name}"
    return AZURE_CONV_MEDIAN, AZURE_CONV_LOG_SIGMA, "Azure LLM 2023 conversation trace: median 129, log-sigma 0.86"


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "peft"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out


def _quiet_transformers() -> None:
    from polyserve.profiler.bench_batching import _quiet_transformers as quiet
    quiet()


# ---------------------------------------------------------------------- fit-splitwise, list, show
def cmd_fit_splitwise(args, argv: list[str]) -> int:
    from polyserve.core import profile_fit
    try:
        prof = profile_fit.build_profile(args.splitwise, args.model, args.hardware, args.tp, args.output_trace or None)
    except (OSError, ValueError, KeyError) as exc:
        print(f"profile fit-splitwise: {exc}", file=sys.stderr)
        return 2
    prof["command"] = "polyserve profile " + shlex.join(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=2) + "\n")
    print(f"# {prof['command']}")
    print(f"# {prof['name']}: fitted from {prof['source']['file']} rows {prof['source']['filter']}; "
          f"prefill rows {prof['source']['prefill_rows']}, decode rows {prof['source']['decode_rows']}")
    for phase in ("prefill", "decode"):
        q = prof["fit"][phase]
        print(f"{phase:<8} R2={q['r2']:.4f}  max rel err={q['max_rel_err']:.3f}  rows={q['rows']}  {q['form']}")
    print(f"k1={prof['k1']:.6g} c1={prof['c1']:.6g} k2={prof['k2']:.6g} c2={prof['c2']:.6g} c3={prof['c3']:.6g} "
          f"kv_capacity_tokens={prof['kv_capacity_tokens']} ({prof['kv_capacity_source'].split(':')[0]}) -> {args.out}")
    return 0


def _origin(p: fitmod.Profile) -> str:
    s = p.source
    if "file" in s:
        return f"fitted from {s['file']} {s.get('filter', '')}"
    return f"{'measured' if p.measured else 'simulated'}: {s.get('engine')} {s.get('model')} on " \
           f"{s.get('measured_on')} ({s.get('device_name', '')}) {s.get('date', '')}"


def cmd_list(args, argv: list[str]) -> int:
    others = sorted(p.name for p in Path(args.dir).glob("*.json") if not fitmod.is_engine_profile(p))
    for p in fitmod.list_profiles(args.dir):
        print(f"{p.name}  [{Path(p.path).name}]")
        print(f"  {_origin(p)}")
        command = json.loads(Path(p.path).read_text()).get("command")
        if command:
            print(f"  command: {command}")
        for line in fitmod.summary_lines(p.fit):
            print(f"  {line}")
    if others:
        print(f"(not LLM engine profiles, skipped: {', '.join(others)})")
    return 0


def cmd_show(args, argv: list[str]) -> int:
    p = fitmod.read_profile(args.file)
    print(f"{p.name}: {_origin(p)}")
    print(f"perf: {p.perf}")
    print(f"kv: capacity {p.kv_capacity_tokens} tokens, {p.kv_bytes_per_token} B/token")
    for line in fitmod.summary_lines(p.fit):
        print(line)
    for key, m in p.lora.items():
        print(f"lora {key}: {m}")
    return 0


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="polyserve profile", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run an engine through the grid, fit, write a profile")
    run.add_argument("--engine", choices=("hf", "sim"), default="hf")
    run.add_argument("--model-path", default="", help="hf: local checkpoint directory (default: small random Llama)")
    run.add_argument("--model", default="", help="model name to report")
    run.add_argument("--random-arch", default="", help="hf: JSON overrides of the random Llama's config")
    run.add_argument("--device", default="cpu")
    run.add_argument("--dtype", default="float32")
    run.add_argument("--profile", default="", help="sim: profile to replay (default: the shipped one)")
    run.add_argument("--time-scale", type=float, default=0.02, help="sim: x modelled time (times are divided back)")
    run.add_argument("--out", required=True)
    run.add_argument("--name", default="")
    run.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    for flag in ("prefill-lengths", "prefill-counts", "decode-batches", "decode-contexts", "lora-ranks",
                 "lora-batches"):
        run.add_argument(f"--{flag}", default=None, help="comma-separated ints")
    run.add_argument("--decode-steps", type=int, default=None)
    run.add_argument("--repeats", type=int, default=None)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--no-lora", action="store_true")
    run.add_argument("--output-trace", default=str(AZURE_CONV), help="trace for the output-length fields")
    run.add_argument("--quiet", action="store_true")
    run.set_defaults(fn=cmd_run)
    fs = sub.add_parser("fit-splitwise", help="fit a GPU profile from the Splitwise CSV")
    fs.add_argument("--splitwise", default=str(SPLITWISE))
    fs.add_argument("--model", default="llama2-70b")
    fs.add_argument("--hardware", default="h100-80gb")
    fs.add_argument("--tp", type=int, default=4)
    fs.add_argument("--output-trace", default=str(AZURE_CONV))
    fs.add_argument("--out", required=True)
    fs.set_defaults(fn=cmd_fit_splitwise)
    ls = sub.add_parser("list", help="profiles with their source and fit quality")
    ls.add_argument("--dir", default=str(fitmod.PROFILES_DIR))
    ls.set_defaults(fn=cmd_list)
    show = sub.add_parser("show", help="one profile's fits")
    show.add_argument("file")
    show.set_defaults(fn=cmd_show)
    sub.add_parser("bench-batching", help="continuous vs static vs one-at-a-time batching (own flags)",
                   add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--encoder" in argv:
        from polyserve.profiler.encoder import main as encoder_main
        return encoder_main(argv)
    if argv and argv[0] == "bench-batching":
        from polyserve.profiler import bench_batching
        return bench_batching.main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.fn(args, argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
