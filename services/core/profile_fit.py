"""Fit Aladdin's performance models (§3) to measured runs and write a sim profile.

The shipped default profile was made with::

    python -m polyserve.core.profile_fit \\
        --splitwise ../shared/datasets/profiles/splitwise_llama2_70b_bloom_176b_a100_h100.csv \\
        --model llama2-70b --hardware h100-80gb --tp 4 \\
        --output-trace ../shared/datasets/traces/azure_llm_2023_conv.csv \\
        --out services/core/profiles/sim-llama2-70b-h100-tp4.json

Fits (least squares, `numpy.linalg.lstsq`) on the rows of one model, hardware
and tensor-parallel degree of the Splitwise profile (times in ms):

* prefill: prompt_time = k1·(prompt_size·batch_size) + c1 (Eq. 2, Σl_in over the
  batch). Rows with batch_size 64 are left out: the dataset README warns that
  their prompt time drops anomalously on some configurations.
* decode: token_time = (k2·l_avg + c2)·b + c3 (Eq. 3) with b = batch_size and
  l_avg = prompt_size + token_size/2, the mean context length over the decode
  phase (context grows linearly from prompt_size to prompt_size + token_size).
  All rows are used; token_time is the mean time per output token of a run.
* KV (Eq. 1): kv = h·(l_in + l_out) + j in tokens, h = 1, j = 0: the capacity is
  expressed in tokens, estimated as M = TP·GPU memory·0.9 (vLLM's default
  gpu_memory_utilization) − fp16 weights (Aladdin §4.1), divided by the fp16 KV
  bytes per token of the model (2 · layers · KV heads · head dim · 2 bytes). No
  measurement of it is in the dataset, so the profile says it is derived.
* output lengths: median and log-space standard deviation of `GeneratedTokens`
  in the Azure LLM conversation trace (median 129) when `--output-trace` is
  given, else those two figures as defaults.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# fp16 weights and KV layout of the models in the Splitwise profile.
MODELS = {
    "llama2-70b": {"params": 68.98e9, "layers": 80, "kv_heads": 8, "head_dim": 128},  # GQA
    "bloom-176b": {"params": 176.25e9, "layers": 70, "kv_heads": 112, "head_dim": 128},  # MHA
}
GPU_MEM_BYTES = {"a100-80gb": 80 * 2**30, "h100-80gb": 80 * 2**30, "h100-80gb-pcap": 80 * 2**30}
MEM_UTIL = 0.9
AZURE_CONV_MEDIAN, AZURE_CONV_LOG_SIGMA = 129, 0.86


@dataclass(frozen=True)
class Fit:
    """Least-squares coefficients and how well they explain the rows."""

    coef: list[float]
    r2: float
    max_rel_err: float
    rows: int


def lstsq(x: np.ndarray, y: np.ndarray) -> Fit:
    """Ordinary least squares of y on the columns of x, with R² and max |relative error|."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return Fit([float(c) for c in coef], r2, float(np.max(np.abs(pred - y) / np.abs(y))), len(y))


def read_rows(path: str | Path, model: str, hardware: str, tp: int) -> list[dict[str, float]]:
    """Rows of the Splitwise profile for one model, hardware and TP degree, as numbers."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["model"] == model and row["hardware"] == hardware and int(row["tensor_parallel"]) == tp:
                out.append({k: float(row[k]) for k in ("prompt_size", "batch_size", "token_size",
                                                       "prompt_time", "token_time")})
    if not out:
        raise ValueError(f"no rows for model={model} hardware={hardware} tensor_parallel={tp} in {path}")
    return out


def fit_prefill(rows: list[dict[str, float]], max_batch: int = 63) -> Fit:
    """prompt_time = k1·(prompt_size·batch_size) + c1 over rows with batch_size <= max_batch."""
    sel = [r for r in rows if r["batch_size"] <= max_batch]
    x = np.array([[r["prompt_size"] * r["batch_size"], 1.0] for r in sel])
    return lstsq(x, np.array([r["prompt_time"] for r in sel]))


def fit_decode(rows: list[dict[str, float]]) -> Fit:
    """token_time = (k2·l_avg + c2)·b + c3 with l_avg = prompt_size + token_size/2."""
    x = np.array([[(r["prompt_size"] + r["token_size"] / 2) * r["batch_size"], r["batch_size"], 1.0]
                  for r in rows])
    return lstsq(x, np.array([r["token_time"] for r in rows]))


def kv_capacity(model: str, hardware: str, tp: int, mem_util: float = MEM_UTIL) -> tuple[int, int, str]:
    """(capacity in tokens, KV bytes per token, how it was derived) for fp16 weights and KV."""
    spec, gpu = MODELS[model], GPU_MEM_BYTES[hardware]
    per_token = 2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * 2
    free = tp * gpu * mem_util - spec["params"] * 2
    tokens = int(free // per_token)
    how = (f"derived, not measured: ({tp} GPUs x {gpu / 2**30:.0f} GiB x {mem_util} - {spec['params'] / 1e9:.2f}e9 "
           f"params x 2 B) / {per_token} B per token (2 x {spec['layers']} layers x {spec['kv_heads']} KV heads "
           f"x {spec['head_dim']} x 2 B); activations and CUDA graphs not subtracted")
    return tokens, per_token, how


def output_lengths(trace: str | Path) -> tuple[int, float]:
    """Median and log-space standard deviation of GeneratedTokens in an Azure LLM trace."""
    with open(trace, newline="") as f:
        gen = np.array([max(1, int(r["GeneratedTokens"])) for r in csv.DictReader(f)], dtype=float)
    return int(np.median(gen)), float(np.std(np.log(gen)))


def sha256(path: str | Path) -> str:
    """Hex digest of a file, to pin which data a profile came from."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_profile(splitwise: str | Path, model: str, hardware: str, tp: int,
                  output_trace: str | Path | None = None) -> dict:
    """The profile dict: coefficients, KV capacity, output lengths, fit quality and provenance."""
    rows = read_rows(splitwise, model, hardware, tp)
    pre, dec = fit_prefill(rows), fit_decode(rows)
    kv_tokens, kv_bytes, kv_how = kv_capacity(model, hardware, tp)
    if output_trace:
        median, sigma = output_lengths(output_trace)
        out_src = f"median and log-sigma of GeneratedTokens in {Path(output_trace).name}"
    else:
        median, sigma = AZURE_CONV_MEDIAN, AZURE_CONV_LOG_SIGMA
        out_src = "Azure LLM 2023 conversation trace: median 129 tokens, log-sigma 0.86"
    k1, c1 = pre.coef
    k2, c2, c3 = dec.coef
    return {
        "name": f"sim-{model}-{hardware.replace('-80gb', '')}-tp{tp}",
        "simulated": True,
        "note": "drives the sim engine, a simulator: timings it produces are modelled, not measured",
        "model": model, "hardware": hardware, "tensor_parallel": tp,
        "k1": k1, "c1": c1, "k2": k2, "c2": c2, "c3": c3, "h": 1.0, "j": 0.0,
        "units": {"k1": "ms per prompt token in the prefill batch", "c1": "ms",
                  "k2": "ms per context token per sequence", "c2": "ms per sequence", "c3": "ms",
                  "h": "KV tokens per token", "j": "KV tokens"},
        "kv_capacity_tokens": kv_tokens, "kv_bytes_per_token": kv_bytes, "kv_capacity_source": kv_how,
        "median_output_tokens": median, "output_log_sigma": round(sigma, 4),
        "output_length_source": out_src,
        "fit": {
            "prefill": {"form": "prompt_time_ms = k1*(prompt_size*batch_size) + c1", **_quality(pre)},
            "decode": {"form": "token_time_ms = (k2*l_avg + c2)*batch_size + c3, "
                               "l_avg = prompt_size + token_size/2", **_quality(dec)},
        },
        "source": {
            "file": Path(splitwise).name,
            "sha256": sha256(splitwise),
            "origin": "Mutinifni/splitwise-sim data/perf_model.csv (MIT)",
            "filter": {"model": model, "hardware": hardware, "tensor_parallel": tp},
            "prefill_rows": f"{pre.rows} of {len(rows)}: batch_size 64 excluded (anomalous prompt_time)",
            "decode_rows": f"{dec.rows} of {len(rows)}: all",
        },
    }


def _quality(fit: Fit) -> dict:
    d = asdict(fit)
    d.pop("coef")
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI: fit, print a summary, write the JSON profile."""
    ap = argparse.ArgumentParser(prog="python -m polyserve.core.profile_fit", description=__doc__.split("\n")[0])
    ap.add_argument("--splitwise", required=True, help="splitwise_llama2_70b_bloom_176b_a100_h100.csv")
    ap.add_argument("--model", default="llama2-70b", choices=sorted(MODELS))
    ap.add_argument("--hardware", default="h100-80gb", choices=sorted(GPU_MEM_BYTES))
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--output-trace", default=None, help="Azure LLM trace CSV for output lengths")
    ap.add_argument("--out", required=True, help="profile JSON to write")
    args = ap.parse_args(argv)
    try:
        prof = build_profile(args.splitwise, args.model, args.hardware, args.tp, args.output_trace)
    except (OSError, ValueError, KeyError) as exc:
        print(f"profile_fit: {exc}", file=sys.stderr)
        return 2
    prof["command"] = "python -m polyserve.core.profile_fit " + " ".join(
        sys.argv[1:] if argv is None else argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=2) + "\n")
    for phase in ("prefill", "decode"):
        q = prof["fit"][phase]
        print(f"{phase}: R2={q['r2']:.4f} max rel err={q['max_rel_err']:.3f} rows={q['rows']}")
    print(f"k1={prof['k1']:.6g} c1={prof['c1']:.6g} k2={prof['k2']:.6g} c2={prof['c2']:.6g} "
          f"c3={prof['c3']:.6g} kv_capacity_tokens={prof['kv_capacity_tokens']} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
