"""Rows, tables, plots and files of `polyserve bench replay` (and `bench fidelity`).

A live replay's row is computed by the simulator's own `simulator.report.metrics`, from a
`RunResult` carrying the replayed requests, so that live (MEASURED) and simulated rows mean
the same thing; `sim_row` runs the same requests through `simulate_requests` (SIMULATED).
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from polyserve.simulator import report
from polyserve.simulator.cluster import RunResult, SimConfig

if TYPE_CHECKING:
    from polyserve.bench.replay import LiveRequest


def _run_result(per: list[tuple[float, float, float, int, str]], label: str, ttft_slo_ms: float,
                atgt_slo_ms: float, workers: int | None) -> RunResult:
    """A RunResult carrying per-request (arrival_s, ttft_ms, e2e_ms, output tokens, error) so that
    `simulator.report.metrics` computes the row with the simulator's very definitions."""
    reqs = []
    for k, (a, ttft, e2e, out, err) in enumerate(per):
        ok = not err and math.isfinite(ttft) and math.isfinite(e2e)
        reqs.append(SimpleNamespace(idx=k, arrival=a, first_token=a + ttft / 1e3 if ok else -1.0,
                                    finish=a + e2e / 1e3 if ok else -1.0, admitted=a, output_len=max(1, out),
                                    rejected="" if ok else (err or "failed")))
    ends = [r.finish for r in reqs if r.finish >= 0] or [0.0]
    conf = asdict(SimConfig(workers=workers or 1, ttft_slo_ms=ttft_slo_ms, atgt_slo_ms=atgt_slo_ms))
    conf["policy"] = label
    kw = {"config": conf, "requests": reqs, "horizon_s": max(ends) - (per[0][0] if per else 0.0),
          "gpu_seconds": 0.0, "gpus_peak": 0, "timeline": [], "counters": {"aborted": False, "slo_misses": 0},
          "wall_s": 0.0}
    names = {f.name for f in fields(RunResult)}
    return RunResult(**{k: v for k, v in kw.items() if k in names})


def live_row(reqs: list[LiveRequest], ttft_slo_ms: float, atgt_slo_ms: float, label: str = "live",
             workers: int | None = None) -> tuple[dict, report.Latencies]:
    """The simulator's row for a live replay (queue_ms is unknown from outside: equals 0)."""
    per = [(r.sent_s if math.isfinite(r.sent_s) else r.arrival_s, r.ttft_ms, r.e2e_ms,
            r.completion_tokens if r.completion_tokens > 0 else r.output_tokens, r.error) for r in reqs]
    run = _run_result(per, label, ttft_slo_ms, atgt_slo_ms, workers)
    row = report.metrics(run, label=label)
    lag = np.array([(r.sent_s - r.arrival_s) * 1e3 for r in reqs if math.isfinite(r.sent_s)])
    errs = Counter(r.error.split(":")[0] for r in reqs if r.error)
    row.update(simulated=False, measured=True, queue_ms=None, gpu_seconds=None, gpus_mean=None, gpus_peak=None,
               workers=workers, errors=dict(errs), error_examples=sorted({r.error for r in reqs if r.error})[:5],
               send_lag_ms={"mean": float(lag.mean()) if lag.size else None,
                            "max": float(lag.max()) if lag.size else None})
    return row, report.latencies(run)


def sim_row(reqs: list[LiveRequest], profile, *, workers: int, max_batch: int, ttft_slo_ms: float,
            atgt_slo_ms: float, max_waiting: int = 256, policy: str = "least_outstanding",
            label: str = "simulator", shift_ms: float = 0.0) -> tuple[dict, report.Latencies, list]:
    """The same requests (their send times, the engine's token counts where known) through
    `simulate_requests` with the sim engine's assumptions (KV reserved at admission);
    `shift_ms` is added to every TTFT and end-to-end latency (a fixed control-plane cost)."""
    from polyserve.simulator import simulate_requests

    base = [(r.sent_s if math.isfinite(r.sent_s) else r.arrival_s,
             r.prompt_tokens if r.prompt_tokens > 0 else r.input_tokens,
             r.completion_tokens if r.completion_tokens > 0 else r.output_tokens) for r in reqs]
    lat = simulate_requests(base, profile, workers=workers, policy=policy, max_batch=max_batch,
                            kv_mode="reserve", max_waiting=max_waiting)
    if shift_ms:
        lat = [replace(x, ttft_ms=x.ttft_ms + shift_ms, e2e_ms=x.e2e_ms + shift_ms) for x in lat]
    per = [(x.arrival_s, x.ttft_ms, x.e2e_ms, x.output_tokens, x.rejected) for x in lat]
    run = _run_result(per, label, ttft_slo_ms, atgt_slo_ms, workers)
    row = report.metrics(run, label=label)
    row.update(simulated=True, gpu_seconds=None, gpus_mean=None, gpus_peak=None, workers=workers)
    return row, report.latencies(run), lat


def table(rows: list[dict], title: str = "") -> str:
    """The simulator's table, headed to say which rows are measured and which simulated."""
    shown = [{**r, "label": r["label"] + (" (SIMULATED)" if r.get("simulated") else " (measured)"),
              "gpus_peak": "-"} for r in rows]  # no GPUs here: workers are in the JSON
    lines = report.table(shown, title).splitlines()
    return "\n".join([f"LIVE REPLAY (measured; rows marked SIMULATED are not): {title}", *lines[1:]])


def plot_cdfs(runs: dict[str, report.Latencies], path: str | Path, title: str) -> Path:
    """TTFT, ATGT and end-to-end CDFs, live (measured) and simulated lines on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, unit) in zip(axes, (("ttft", "TTFT (ms)"), ("atgt", "ATGT (ms/token)"), ("e2e", "end-to-end (s)"))):
        for label, lat in runs.items():
            x = np.sort(getattr(lat, name)) / (1000.0 if name == "e2e" else 1.0)
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label, lw=1.3,
                        ls="--" if "SIMULATED" in label else "-")
        ax.set_xlabel(unit)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{title} — live: measured; dashed: SIMULATED", fontsize=11)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_json(path: str | Path, payload: dict) -> Path:
    def default(o):
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        return str(o)

    Path(path).write_text(json.dumps(payload, indent=2, default=default) + "\n")
    return Path(path)


def requests_json(reqs: list[LiveRequest]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}
            for r in reqs]


def now_tag() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
