"""PNG figures of simulated runs (matplotlib, Agg backend). Every figure says SIMULATED
in its title and in a watermark."""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from polyserve.simulator.report import LABEL, Latencies


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark(fig, title: str) -> None:
    fig.suptitle(f"{title} — {LABEL}", fontsize=11)
    fig.text(0.99, 0.01, f"{LABEL} (trace-driven, modelled timings)", ha="right", va="bottom", fontsize=8,
             color="firebrick", alpha=0.8)


def latency_cdfs(runs: Mapping[str, Latencies], path: str | Path, title: str = "Latency CDFs",
                 slo: Mapping[str, float] | None = None) -> Path:
    """TTFT, ATGT and end-to-end CDFs, one line per run."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, unit) in zip(axes, (("ttft", "TTFT (ms)"), ("atgt", "ATGT (ms/token)"), ("e2e", "end-to-end (s)"))):
        for label, lat in runs.items():
            x = np.sort(getattr(lat, name))
            if name == "e2e":
                x = x / 1000.0
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label, lw=1.3)
        if slo and name in slo:
            ax.axvline(slo[name], color="k", ls="--", lw=0.8, label=f"SLO {slo[name]:g}")
        ax.set_xlabel(unit)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        if name != "atgt":
            ax.set_xscale("log")
    axes[0].legend(fontsize=7, loc="lower right")
    _mark(fig, title)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def versus_load(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, ylabel: str,
                title: str, xlabel: str = "arrival rate (req/s)", hline: float | None = None) -> Path:
    """One line per series of (load, value) points (SLO attainment vs load, GPUs vs load)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, color="k", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _mark(fig, title)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _arrival_rate(arrivals: np.ndarray, horizon: float, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    edges = np.arange(0.0, max(horizon, bin_s) + bin_s, bin_s)
    counts = np.histogram(arrivals, bins=edges)[0]
    return edges[:-1], counts / bin_s


def _rate_axis(ax, arrivals: np.ndarray, horizon: float, bin_s: float):
    t, rate = _arrival_rate(arrivals, horizon, bin_s)
    ax2 = ax.twinx()
    ax2.step(t, rate, where="post", color="0.6", lw=1.0, label=f"arrival rate ({bin_s:g} s bins)")
    ax2.set_ylabel("arrival rate (req/s)", color="0.4")
    return ax2


def workers_over_time(runs: Mapping[str, Sequence[tuple[float, int]]], arrivals: np.ndarray, horizon: float,
                      path: str | Path, title: str, bin_s: float = 60.0) -> Path:
    """Workers up over time, one step line per autoscaler, with the arrival rate."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for label, tl in runs.items():
        if tl:
            t, n = zip(*tl)
            ax.step(list(t) + [horizon], list(n) + [n[-1]], where="post", label=label, lw=1.4)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("workers up")
    ax.grid(alpha=0.3)
    ax2 = _rate_axis(ax, arrivals, horizon, bin_s)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    _mark(fig, title)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def clock_over_time(runs: Mapping[str, dict], arrivals: np.ndarray, horizon: float, path: str | Path, title: str,
                    bin_s: float = 30.0, smooth_s: float = 30.0) -> Path:
    """µ-Serve Fig. 13 style: mean SM clock of the workers (MHz, averaged over `smooth_s`)
    and the arrival rate over time (top); the cluster's power (W, bottom)."""
    plt = _plt()
    fig, (ax, axp) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for label, x in runs.items():
        t, f = np.asarray(x.get("clock_t", [])), np.asarray(x.get("clock_mean_mhz", []))
        if t.size:
            edges = np.arange(0.0, horizon + smooth_s, smooth_s)
            k = np.clip(np.digitize(t, edges) - 1, 0, edges.size - 2)
            s = np.bincount(k, weights=f, minlength=edges.size - 1)
            c = np.bincount(k, minlength=edges.size - 1)
            ok = c > 0
            ax.plot(edges[:-1][ok], s[ok] / c[ok], label=f"{label} clock", lw=1.3)
        if x.get("power_t"):
            axp.step(x["power_t"], x["power_w"], where="post", label=label, lw=1.1)
    ax.set_ylabel(f"mean SM clock (MHz, {smooth_s:g} s avg)")
    ax.grid(alpha=0.3)
    ax2 = _rate_axis(ax, arrivals, horizon, bin_s)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower left")
    axp.set_xlabel("time (s)")
    axp.set_ylabel("cluster power (W, modelled)")
    axp.grid(alpha=0.3)
    axp.legend(fontsize=8)
    _mark(fig, title)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# ------------------------------------------------------------------ `polyserve simulate`'s figures
def grid_figures(rows: list[dict], cdfs: Mapping[tuple[str, float], Mapping[str, Latencies]], out: Path,
                 slo: Mapping[str, float], target: float) -> list[Path]:
    """`polyserve simulate`'s figures of a grid: latency CDFs per trace x rate, and SLO
    attainment, GPUs and mean JCT versus load per trace (with at least two loads)."""
    made = []
    for (name, scale), runs in cdfs.items():
        made.append(latency_cdfs(runs, out / f"cdf_{name}_x{scale:g}.png", f"{name} at {scale:g}x rate", slo))
    for name in dict.fromkeys(r["trace"] for r in rows):
        sel = [r for r in rows if r["trace"] == name]
        if len({r["load"] for r in sel}) < 2:
            continue
        by = functools.partial(_by_label, sel)
        made.append(versus_load(by("slo_both"), out / f"slo_vs_load_{name}.png", hline=target,
                                ylabel="SLO attainment (TTFT and ATGT)", title=f"SLO attainment vs load, {name}"))
        made.append(versus_load(by("gpus_mean"), out / f"gpus_vs_load_{name}.png",
                                ylabel="GPUs (mean over the run)", title=f"GPUs vs load, {name}"))
        jct = {lab: [(x, r["e2e_ms"]["mean"] / 1000.0) for x, r in pts if r["e2e_ms"]["mean"] is not None]
               for lab, pts in by(None).items()}
        made.append(versus_load(jct, out / f"jct_vs_load_{name}.png", ylabel="mean job completion time (s)",
                                title=f"Mean JCT (end-to-end latency) vs load, {name}"))
    return made


def _by_label(sel: list[dict], key: str | None) -> dict[str, list]:
    """label -> [(load, row[key] (the row itself when key is None))] over the rows with a value."""
    return {lab: [(r["load"], r[key] if key else r) for r in sel
                  if r["label"] == lab and (key is None or r[key] is not None)]
            for lab in dict.fromkeys(r["label"] for r in sel)}


def series_figures(series: dict, out: Path) -> list[Path]:
    """Workers over time per autoscaler and clock/power over time (µ-Serve Fig. 13), per trace x load x SLO."""
    made = []
    for (name, scale, slo), d in series.items():
        tag = f"{name}_x{scale:g}" + (f"_slo{slo:g}" if slo != 1 else "")
        horizon = max(h for _, _, h, _ in d["runs"].values())
        scaled = {lab: tl for lab, (tl, _, _, cfg) in d["runs"].items() if cfg.autoscaler}
        if scaled:
            made.append(workers_over_time(scaled, d["arrivals"], horizon, out / f"workers_{tag}.png",
                                          f"Workers over time per autoscaler, {name} at {scale:g}x rate"))
        clocked = {lab: x for lab, (_, x, _, cfg) in d["runs"].items() if cfg.clock}
        if clocked:
            made.append(clock_over_time(clocked, d["arrivals"], horizon, out / f"clock_{tag}.png",
                                        f"SM clock, arrival rate and power, {name} at {scale:g}x rate, SLO x{slo:g}"))
    return made
