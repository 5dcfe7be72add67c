"""PNG figures of simulated runs (matplotlib, Agg backend). Every figure says SIMULATED
in its title and in a watermark."""
from __future__ import annotations

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
