"""Workload inputs of the simulator: request traces and LoRA adapters.

* Azure LLM inference traces (``TIMESTAMP,ContextTokens,GeneratedTokens``, e.g.
  ``../shared/datasets/traces/azure_llm_2023_conv.csv``): arrivals in seconds from the
  first request, input and output lengths. `window` takes a time slice of the original
  timeline, rescales the rate (inter-arrival times ÷ `rate_scale`) and cuts the result
  to a duration.
* LoRA adapters (CaraServe §7.1): one adapter per function of the Azure Functions 2019
  sample (``azure_functions_2019_sample1000_invocations.csv``), its popularity the
  function's invocations over the day; ranks drawn uniformly from a set with a seed.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

from polyserve.shared.paths import datasets_dir  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival (seconds from the first)."""

    name: str
    arrival: np.ndarray  # float64 seconds
    input_len: np.ndarray  # int64
    output_len: np.ndarray  # int64 (>= 1)

    def __len__(self) -> int:
        return int(self.arrival.size)

    @property
    def duration_s(self) -> float:
        return float(self.arrival[-1] - self.arrival[0]) if len(self) > 1 else 0.0

    @property
    def rate(self) -> float:
        """Mean arrivals per second."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else 0.0


def _seconds(ts: str) -> float:
    day, _, clock = ts.strip().partition(" ")
    h, m, s = clock.split(":")
    return date.fromisoformat(day).toordinal() * 86400.0 + int(h) * 3600 + int(m) * 60 + float(s)


def load_azure_llm(path: str | Path) -> Trace:
    """An Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    t, i, o = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            t.append(_seconds(row["TIMESTAMP"]))
            i.append(int(row["ContextTokens"]))
            o.append(int(row["GeneratedTokens"]))
    if not t:
        raise ValueError(f"{path}: no requests")
    arr = np.asarray(t)
    order = np.argsort(arr, kind="stable")
    arr = arr[order] - arr[order][0]
    return Trace(Path(path).stem, arr, np.asarray(i, dtype=np.int64)[order],
                 np.maximum(1, np.asarray(o, dtype=np.int64)[order]))


def from_requests(requests: Sequence[tuple[float, int, int]], name: str = "requests") -> Trace:
    """A trace from (arrival_s, input_len, output_len) tuples (any order)."""
    if not requests:
        raise ValueError("no requests")
    a = np.asarray(requests, dtype=float)
    order = np.argsort(a[:, 0], kind="stable")
    a = a[order]
    return Trace(name, a[:, 0].astype(float), a[:, 1].astype(np.int64), np.maximum(1, a[:, 2].astype(np.int64)))


def window(trace: Trace, *, start_s: float = 0.0, end_s: float | None = None, rate_scale: float = 1.0,
           duration_s: float | None = None) -> Trace:
    """Requests of [start_s, end_s) of the original timeline, arrivals rescaled by
    1/rate_scale (2.0 = twice the rate) and re-based to 0, then the first `duration_s`."""
    if rate_scale <= 0:
        raise ValueError("rate_scale must be > 0")
    a = trace.arrival
    mask = a >= start_s
    if end_s is not None:
        mask &= a < end_s
    arr = a[mask]
    if arr.size == 0:
        raise ValueError(f"no requests of {trace.name} in [{start_s}, {end_s})")
    arr = (arr - arr[0]) / rate_scale
    keep = arr <= duration_s if duration_s is not None else np.ones(arr.size, dtype=bool)
    suffix = f"x{rate_scale:g}" if rate_scale != 1 else ""
    return Trace(trace.name + suffix, arr[keep], trace.input_len[mask][keep], trace.output_len[mask][keep])


# ------------------------------------------------------------------ LoRA adapters
@dataclass(frozen=True)
class Adapters:
    """Adapters with their ranks and invocation probabilities."""

    names: tuple[str, ...]
    ranks: np.ndarray
    probs: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


def function_popularity(path: str | Path) -> tuple[list[str], np.ndarray]:
    """(function hashes, invocations over the whole day) of the Azure Functions sample."""
    names, counts = [], []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        cols = [k for k, h in enumerate(header) if h.startswith("minute_")]
        for row in reader:
            names.append(row[0])
            counts.append(sum(int(row[k] or 0) for k in cols))
    return names, np.asarray(counts, dtype=float)


def make_adapters(functions_csv: str | Path, n: int = 0, ranks: Sequence[int] = (8, 16, 32, 64),
                  seed: int = 0) -> Adapters:
    """One adapter per function (the `n` most invoked; 0 = all that were invoked), popularity
    ∝ its invocations, rank drawn uniformly from `ranks` with `seed`."""
    names, counts = function_popularity(functions_csv)
    order = np.argsort(-counts, kind="stable")
    order = order[counts[order] > 0]
    if n:
        order = order[:n]
    rng = np.random.default_rng(seed)
    c = counts[order]
    return Adapters(tuple(f"fn-{names[k][:10]}" for k in order),
                    rng.choice(np.asarray(ranks, dtype=np.int64), size=order.size), c / c.sum())


def assign_adapters(n_requests: int, adapters: Adapters, seed: int = 0) -> np.ndarray:
    """Adapter index of each request, drawn by popularity."""
    return np.random.default_rng(seed + 1).choice(len(adapters), size=n_requests, p=adapters.probs)
