"""Per-run metrics, the results table (text) and JSON. Everything is labelled SIMULATED.

Metrics of one run (latencies in ms; requests that were rejected count as SLO misses):

* SLO attainment: share of requests with TTFT ≤ T_pre, with ATGT ≤ T_dec, and with both;
* TTFT, ATGT (Aladdin: decode time ÷ (output tokens − 1); 0 for one-token outputs) and
  end-to-end latency (= job completion time): mean, P50, P98, P99;
* GPUs: peak GPUs up (workers × tensor-parallel degree), GPU-seconds, and their mean
  over the run (GPU-seconds ÷ horizon).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyserve.simulator.cluster import RunResult

LABEL = "SIMULATED"
PCTS = (50, 98, 99)


@dataclass(frozen=True)
class Latencies:
    """Per-request latencies of the completed requests (ms), in arrival order."""

    ttft: np.ndarray
    atgt: np.ndarray
    e2e: np.ndarray
    queue: np.ndarray
    rejected: int


def latencies(res: RunResult) -> Latencies:
    done = [r for r in res.requests if not r.rejected and r.finish >= 0]
    ttft = np.array([(r.first_token - r.arrival) * 1000.0 for r in done])
    atgt = np.array([(r.finish - r.first_token) * 1000.0 / (r.output_len - 1) if r.output_len > 1 else 0.0
                     for r in done])
    e2e = np.array([(r.finish - r.arrival) * 1000.0 for r in done])
    queue = np.array([(r.admitted - r.arrival) * 1000.0 for r in done])
    return Latencies(ttft, atgt, e2e, queue, len(res.requests) - len(done))


def _stats(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PCTS}}
    return {"mean": float(x.mean()), **{f"p{p}": float(np.percentile(x, p)) for p in PCTS}}


def metrics(res: RunResult, label: str = "") -> dict:
    """The row of the results table for one run."""
    lat = latencies(res)
    cfg = res.config
    n = len(res.requests)
    ok_t = lat.ttft <= cfg["ttft_slo_ms"]
    ok_a = lat.atgt <= cfg["atgt_slo_ms"]
    dur = max(res.horizon_s, 1e-9)
    if res.counters.get("aborted"):  # stopped early: only an upper bound on attainment is known
        bound = 1.0 - res.counters["slo_misses"] / n if n else None
        return {"label": label or f"{cfg['policy']}/{cfg['order']}", "simulated": True, "aborted": True,
                "policy": cfg["policy"], "order": cfg["order"], "kernel": cfg["worker"]["kernel"],
                "requests": n, "completed": int(lat.e2e.size), "rejected": lat.rejected,
                "slo_ttft": None, "slo_atgt": None, "slo_both": bound,
                "ttft_ms": _stats(np.array([])), "atgt_ms": _stats(np.array([])), "e2e_ms": _stats(np.array([])),
                "queue_ms": _stats(np.array([])), "gpus_peak": res.gpus_peak, "gpu_seconds": None,
                "gpus_mean": None, "horizon_s": res.horizon_s, "sim_wall_s": res.wall_s, "counters": res.counters,
                "ttft_slo_ms": cfg["ttft_slo_ms"], "atgt_slo_ms": cfg["atgt_slo_ms"], "fit_errors": None}
    return {
        "label": label or f"{cfg['policy']}/{cfg['order']}",
        "simulated": True,
        "policy": cfg["policy"], "order": cfg["order"], "kernel": cfg["worker"]["kernel"],
        "requests": n, "completed": int(lat.e2e.size), "rejected": lat.rejected,
        "slo_ttft": float(ok_t.sum() / n) if n else None,
        "slo_atgt": float(ok_a.sum() / n) if n else None,
        "slo_both": float((ok_t & ok_a).sum() / n) if n else None,
        "ttft_ms": _stats(lat.ttft), "atgt_ms": _stats(lat.atgt), "e2e_ms": _stats(lat.e2e),
        "queue_ms": _stats(lat.queue),
        "gpus_peak": res.gpus_peak, "gpu_seconds": res.gpu_seconds, "gpus_mean": res.gpu_seconds / dur,
        "horizon_s": res.horizon_s, "sim_wall_s": res.wall_s, "counters": res.counters,
        "ttft_slo_ms": cfg["ttft_slo_ms"], "atgt_slo_ms": cfg["atgt_slo_ms"],
        "fit_errors": res.fit_errors,
    }


def _f(x, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


COLUMNS = ("run", "load", "reqs", "SLO ttft", "SLO atgt", "SLO both", "TTFT mean/p50/p98/p99",
           "ATGT mean/p50/p98/p99", "E2E mean/p50/p98/p99", "GPUs peak", "GPU-s", "GPUs mean")


def table(rows: Sequence[dict], title: str = "") -> str:
    """Fixed-width text table of metric rows (each may carry a "load" entry)."""
    def lat(d: dict) -> str:
        return "/".join(_f(d[k]) for k in ("mean", "p50", "p98", "p99"))

    body = [[r["label"], _f(r.get("load"), "{:g}"), str(r["requests"]), _f(r["slo_ttft"], "{:.3f}"),
             _f(r["slo_atgt"], "{:.3f}"), _f(r["slo_both"], "{:.3f}"), lat(r["ttft_ms"]), lat(r["atgt_ms"]),
             lat(r["e2e_ms"]), str(r["gpus_peak"]), _f(r["gpu_seconds"]), _f(r["gpus_mean"], "{:.1f}")]
            for r in rows]
    widths = [max(len(c), *(len(b[k]) for b in body)) if body else len(c) for k, c in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"{LABEL}: {title}" if title else LABEL, line(COLUMNS), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def write(out_dir: str | Path, payload: dict, text: str) -> tuple[Path, Path]:
    """results.json (payload, marked simulated) and results.txt under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"simulated": True, "note": "every figure here is SIMULATED (trace-driven, modelled timings)",
               **payload}
    pj, pt = out / "results.json", out / "results.txt"
    pj.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    pt.write_text(text + "\n")
    return pj, pt


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
