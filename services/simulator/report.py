"""Per-run metrics, the results table (text) and JSON. Everything is labelled SIMULATED.

Metrics of one run (latencies in ms; requests that were rejected count as SLO misses):

* SLO attainment: share of requests with TTFT ≤ T_pre, with ATGT ≤ T_dec, and with both;
* TTFT, ATGT (Aladdin: decode time ÷ (output tokens − 1); 0 for one-token outputs) and
  end-to-end latency (= job completion time): mean, P50, P98, P99;
* GPUs: peak GPUs up (workers × tensor-parallel degree), GPU-seconds, and their mean
  over the run (GPU-seconds ÷ horizon).
* SLO violations: requests over the TTFT SLO, over the ATGT SLO, over either (count;
  share = 1 − attainment).
* Energy (`simulator.power`, modelled): total J, average cluster power (J ÷ horizon),
  power per GPU (J ÷ GPU-seconds), J per completed request and per output token,
  mean clock.
* Autoscaler runs: time of the first scale-out from the run start and from the first
  load rise, scale-outs/-ins, peak workers.
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
    row = {
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
    row.update(extra_metrics(res, lat, ok_t, ok_a))
    return row


def extra_metrics(res: RunResult, lat: Latencies, ok_t: np.ndarray, ok_a: np.ndarray) -> dict:
    """Violations, energy (simulated) and the autoscaler's figures of one run."""
    cfg, x = res.config, res.extra
    n = len(res.requests)
    done = [r for r in res.requests if not r.rejected and r.finish >= 0]
    tokens = sum(r.output_len for r in done)
    e = x.get("energy_j")
    row = {"slo_scale": cfg.get("slo_scale", 1.0),
           "viol_ttft": int(n - ok_t.sum()), "viol_atgt": int(n - ok_a.sum()),
           "viol_any": int(n - (ok_t & ok_a).sum()),
           "workers_peak": res.gpus_peak // max(1, cfg["worker"]["tp"]),
           "clock": x.get("clock_mode"), "gpu": x.get("gpu"),
           "energy_j": e, "avg_power_w": x.get("avg_power_w"), "power_per_gpu_w": x.get("power_per_gpu_w"),
           "util": x.get("util"),
           "j_per_request": e / len(done) if e is not None and done else None,
           "j_per_token": e / tokens if e is not None and tokens else None,
           "clock_avg_mhz": x.get("clock_avg_mhz"), "miad_decisions": x.get("miad_decisions"),
           "miad_min_mhz": cfg.get("miad_min_mhz"), "miad_floor_mhz": x.get("miad_floor_mhz")}
    if "autoscaler" in x:
        row.update({k: x[k] for k in ("autoscaler", "scaler", "first_scale_out_s", "load_rise_s",
                                      "scale_out_after_rise_s", "rise_to_scale_out_s", "scale_outs",
                                      "scale_ins")})
    return row


def _f(x, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


COLUMNS = ("run", "load", "reqs", "SLO ttft", "SLO atgt", "SLO both", "TTFT mean/p50/p98/p99",
           "ATGT mean/p50/p98/p99", "E2E mean/p50/p98/p99", "GPUs peak", "GPU-s", "GPUs mean")


def table(rows: Sequence[dict], title: str = "") -> str:
    """Fixed-width text table of metric rows (each may carry a "load" entry)."""
    def lat(d: dict) -> str:
        return "/".join(_f(d[k]) for k in ("mean", "p50", "p98", "p99"))

    def both(r: dict) -> str:
        if r.get("target_reached") is False:  # --search-gpus gave up: say so, never print it as reached
            return f"NOT REACHED ({'<=' if r.get('aborted') else ''}{_f(r['slo_both'], '{:.3f}')} at max)"
        return ("<=" if r.get("aborted") else "") + _f(r["slo_both"], "{:.3f}")

    body = [[r["label"], _f(r.get("load"), "{:g}"), str(r["requests"]), _f(r["slo_ttft"], "{:.3f}"),
             _f(r["slo_atgt"], "{:.3f}"), both(r), lat(r["ttft_ms"]), lat(r["atgt_ms"]),
             lat(r["e2e_ms"]), str(r["gpus_peak"]), _f(r["gpu_seconds"]), _f(r["gpus_mean"], "{:.1f}")]
            for r in rows]
    widths = [max(len(c), *(len(b[k]) for b in body)) if body else len(c) for k, c in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"{LABEL}: {title}" if title else LABEL, line(COLUMNS), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def honesty_notes(rows: Sequence[dict], args, base) -> str:
    """What the runs assumed and where they went beyond their models: the predictor model,
    the context window (requests rejected, cut, capped), prefill beyond the profiled prompt
    range, and --search-gpus runs whose target was not reached."""
    out = ["predictor model: " + "; ".join(sorted({r.get("predictor", "?") for r in rows}))]
    lim = base.context_limit
    out.append(f"context limit: {lim} tokens ({getattr(args, 'context_source', '')}), over it: {base.over_context}"
               if lim else f"context limit: none ({getattr(args, 'context_source', '')})")
    keys = ("over_context_rejected", "prompt_truncated", "output_capped", "prefill_extrapolated")
    for r in rows:
        c = r.get("counters") or {}
        hit = {k: c.get(k, 0) for k in keys if c.get(k)}
        if hit:
            out.append(f"  {r.get('trace', '')} {r['label']} x{r.get('rate_scale', 1):g}: "
                       + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in hit.items()))
    prof = getattr(args, "profiled_prompt", 0)
    if prof:
        n = max(((r.get("counters") or {}).get("prefill_extrapolated", 0) for r in rows), default=0)
        out.append(f"profiled prompt range: up to {prof} tokens ({args.profiled_source}); "
                   + (f"PREFILL EXTRAPOLATED beyond it for up to {n} requests per run (see the lines above)"
                      if n else "no prompt beyond it"))
    else:
        out.append(f"profiled prompt range: {getattr(args, 'profiled_source', 'unknown')} — prefill times of long "
                   "prompts may be extrapolated")
    missed = [r for r in rows if r.get("target_reached") is False]
    for r in missed:
        out.append(f"TARGET NOT REACHED: {r.get('trace', '')} {r['label']} x{r.get('rate_scale', 1):g}: even "
                   f"{r.get('workers')} workers (--max-workers) attain {'at most ' if r.get('aborted') else ''}"
                   f"{_f(r['slo_both'], '{:.3f}')} < target")
    return f"{LABEL}: notes\n" + "\n".join(out)


EXTRA_COLUMNS = ("run", "load", "viol TTFT n/%", "viol ATGT n/%", "viol any n/%", "GPU-s", "workers peak",
                 "1st scale-out s (rise to next)", "out/in", "clock MHz avg", "power W avg (per GPU)", "energy MJ",
                 "J/req", "J/token")


def extra_table(rows: Sequence[dict], title: str = "") -> str:
    """Violations, autoscaling and energy per run (all simulated)."""
    def viol(r: dict, k: str) -> str:
        return f"{r[k]}/{100.0 * r[k] / r['requests']:.1f}%" if r.get(k) is not None and r["requests"] else "-"

    def first(r: dict) -> str:
        if "autoscaler" not in r:
            return "-"
        if r["first_scale_out_s"] is None:
            return "none"
        if r.get("load_rise_s") is None:
            return f"{r['first_scale_out_s']:.0f}"
        after = r.get("rise_to_scale_out_s")
        return f"{r['first_scale_out_s']:.0f} (" + (f"+{after:.0f})" if after is not None else "none after)")

    body = [[r["label"], _f(r.get("load"), "{:g}"), viol(r, "viol_ttft"), viol(r, "viol_atgt"), viol(r, "viol_any"),
             _f(r["gpu_seconds"]), str(r.get("workers_peak", "-")), first(r),
             f"{r['scale_outs']}/{r['scale_ins']}" if "autoscaler" in r else "-",
             _f(r.get("clock_avg_mhz")),
             f"{_f(r.get('avg_power_w'))} ({_f(r.get('power_per_gpu_w'))})",
             _f(r["energy_j"] / 1e6 if r.get("energy_j") is not None else None, "{:.2f}"),
             _f(r.get("j_per_request")), _f(r.get("j_per_token"), "{:.1f}")] for r in rows]
    widths = [max(len(c), *(len(b[k]) for b in body)) if body else len(c) for k, c in enumerate(EXTRA_COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"{LABEL}: {title}" if title else LABEL, line(EXTRA_COLUMNS), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


MIAD_COLUMNS = ("run", "load", "SLO x", "max: SLO both", "max: W avg", "MIAD (floor 0): SLO both / W",
                "best MIAD >= target: floor MHz", "SLO both", "W avg", "power max/MIAD", "J/token max/MIAD")


def _floor(r: dict) -> str:
    """A MIAD row's floor: MHz given, 'auto (MHz)' or 'GPU min'."""
    if r.get("miad_min_mhz") == "auto":
        return f"auto ({_f(r.get('miad_floor_mhz'))})"
    return str(r.get("miad_min_mhz") or "GPU min")


def miad_table(rows: Sequence[dict], target: float, title: str = "") -> str:
    """MIAD against the maximum clock at equal SLO attainment: per run group (same load,
    SLO scale, policy, autoscaler), the max-clock row, MIAD at the GPU's minimum floor,
    and the lowest-power MIAD row (over the floors tried) whose attainment (both SLOs)
    is >= `target` (only where the max-clock row reaches `target` too)."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r.get("clock") in ("max", "miad"):
            g = groups.setdefault((r.get("trace"), r.get("load"), r.get("slo_scale"), r.get("group", "")), {})
            g.setdefault(r["clock"], []).append(r)
    body = []
    for (_, load, slo, grp), g in groups.items():
        if not g.get("max") or not g.get("miad"):
            continue
        mx = g["max"][0]
        reach = (mx["slo_both"] or 0.0) >= target
        ok = [r for r in g["miad"] if reach and r["slo_both"] is not None and r["slo_both"] >= target]
        best = min(ok, key=lambda r: r["avg_power_w"]) if ok else None
        floor0 = next((r for r in g["miad"] if not r.get("miad_min_mhz")), None)
        body.append([grp, _f(load, "{:g}"), _f(slo, "{:g}"), _f(mx["slo_both"], "{:.3f}"), _f(mx["avg_power_w"]),
                     f"{_f(floor0['slo_both'], '{:.3f}')} / {_f(floor0['avg_power_w'])}" if floor0 else "-",
                     _floor(best) if best else "none",
                     _f(best["slo_both"], "{:.3f}") if best else "-", _f(best["avg_power_w"]) if best else "-",
                     _f(mx["avg_power_w"] / best["avg_power_w"], "{:.2f}x") if best else "-",
                     _f(mx["j_per_token"] / best["j_per_token"], "{:.2f}x") if best and best["j_per_token"] else "-"])
    widths = [max(len(c), *(len(b[k]) for b in body)) if body else len(c) for k, c in enumerate(MIAD_COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"{LABEL}: {title}" if title else LABEL, line(MIAD_COLUMNS), line(["-" * w for w in widths])]
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
