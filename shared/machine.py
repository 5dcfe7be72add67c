"""The machine a figure was measured on: every benchmark names it (CPU model and the SIMD flags
that change this project's figures, cores, Python, load average).

One CPU class ran the same code 2x faster than another (an AVX-512/AMX Xeon against an
AVX2-only AMD EPYC, docs/benchmarks/overhead.md), so a figure without its CPU's flags cannot be
compared. `platform.processor()` is empty or just the architecture on Linux, so the model and
flags come from /proc/cpuinfo (the first processor's; the others are the same on these VMs).
"""
from __future__ import annotations

import os
import platform

# the flags that decide this project's CPU figures: matmul kernels (torch, the encoder), bf16
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of the first processor listed in `path`; the platform's processor
    string and no flags where it cannot be read (not Linux)."""
    fields: dict[str, str] = {}
    flags: set[str] = set()
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features"):  # x86 / arm64: the last field of interest
                    flags = set(value.split())
                    break
                fields.setdefault(key, value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if fields.get("cpu family") and fields.get("model"):  # e.g. "AMD EPYC" alone names no generation
        model += f" (family {fields['cpu family']} model {fields['model']})"
    return model, flags


def describe(path: str = "/proc/cpuinfo") -> dict:
    """The machine as JSON-ready facts: CPU model, which of `SIMD_FLAGS` it has and has not,
    logical CPUs, Python version, load average now."""
    model, flags = cpu(path)
    return {"cpu": model, "simd": [f for f in SIMD_FLAGS if f in flags],
            "no_simd": [f for f in SIMD_FLAGS if f not in flags] if flags else [],
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def line(facts: dict | None = None) -> str:
    """One line for a benchmark's header: "AMD EPYC, 2 CPUs, avx2 fma, no avx512f ...; Python
    3.11.7; load average 0.52 0.61 0.70"."""
    m = facts or describe()
    simd = " ".join(m["simd"]) or "no flags read"
    if m["no_simd"]:
        simd += ", no " + "/".join(m["no_simd"])
    load = " ".join(f"{x:.2f}" for x in m["load_average"])
    return f"{m['cpu']}, {m['cpus']} CPUs, {simd}; Python {m['python']}; load average {load}"
