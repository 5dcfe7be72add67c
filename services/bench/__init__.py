"""bench: the `polyserve bench <name>` family of benchmarks (scripts that print figures).

Each module is one benchmark. A module either defines `add_arguments(parser)` and
`main(args: Namespace)`, or parses its own arguments in `main(argv)`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

BENCHES: dict[str, tuple[str, str]] = {
    "overhead": ("polyserve.bench.overhead", "control-plane cost vs a bare FastAPI endpoint, side by side"),
    "replay": ("polyserve.bench.replay", "open-loop replay of a request trace against a running gateway"),
    "fidelity": ("polyserve.bench.fidelity", "the same trace slice through a live cluster and the simulator"),
    "dispatch": ("polyserve.bench.dispatch", "dispatch decision latency per policy: O(n) scan vs index"),
    "embeddings": ("polyserve.bench.embeddings", "Arlo polymorphing experiment (ST vs DT vs MLQ)"),
    "lora": ("polyserve.bench.lora", "LoRA TTFT: cold on-demand vs CPU-assisted vs cached (CaraServe)"),
    "grammar": ("polyserve.bench.grammar", "per-token cost of structured outputs (llguidance masks) in the hf engine"),
    "gpu": ("polyserve.bench.gpu", "GPU checks (read-only): NVML energy counter vs integrated power; decode roofline"),
    "arlo": ("polyserve.bench.arlo", "solve time of Arlo's runtime allocation MILP (synthetic instances)"),
    "fairness": ("polyserve.bench.fairness", "per-tenant throughput and latency with and without VTC fair sharing"),
    "chaos": ("polyserve.bench.chaos", "faults by signal under streaming load: lost, short, hung, recovery time"),
    "prefix": ("polyserve.bench.prefix", "prefix-aware placement vs load-only rules on a prefix-hashed trace (SIMULATED workers)"),
    "sjf-live": ("polyserve.bench.sjf_live", "worker queue orders (fcfs, ssjf, ssjf_refine, oracle) on a live hf engine"),
}
"""name -> (module, one-line help)."""


def usage() -> str:
    rows = "\n".join(f"  {name:<11} {help_text}" for name, (_, help_text) in BENCHES.items())
    return f"usage: polyserve bench NAME [options]   (polyserve bench NAME --help)\n\nbenchmarks:\n{rows}"


def main(argv: list[str] | None = None) -> int:
    """`polyserve bench NAME ...`: run one benchmark with the rest of the arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"polyserve bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, help_text = BENCHES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        print(f"`polyserve bench {name}` is not available in this install ({exc})", file=sys.stderr)
        return 2
    if hasattr(mod, "add_arguments"):
        parser = argparse.ArgumentParser(prog=f"polyserve bench {name}", description=help_text)
        mod.add_arguments(parser)
        return int(mod.main(parser.parse_args(rest)) or 0)
    return int(mod.main(rest) or 0)
