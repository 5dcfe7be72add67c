"""Workload inputs of the simulator: request traces and LoRA adapters.

* Azure LLM inference traces (``TIMESTAMP,ContextTokens,GeneratedTokens``, e.g.
  ``../shared/datasets/traces/azure_llm_2023_conv.csv``), or any CSV with such columns under
  other usual names (BurstGPT's ``Timestamp,Request tokens,Response tokens``, ``arrival_time,
  input_tokens,output_tokens``, ...): arrivals in seconds from the first request, input and
  output lengths. `window` takes a time slice of the original
  timeline, rescales the rate (inter-arrival times ÷ `rate_scale`) and cuts the result
  to a duration.
* Synthetic load steps (`synthetic_step`, CLI ``--trace synthetic:step:BASE:PEAK:AT_S:DURATION_S[:RAMP_S]``):
  Poisson arrivals at BASE req/s, then (from AT_S, linearly over RAMP_S, default 0 =
  a step) PEAK req/s until DURATION_S; every request's (input, output) lengths are one
  pair drawn from a real trace (the Azure conv trace by default), so the work per
  request is realistic and only the arrival rate is made up. `Trace.step_s` keeps the
  time of the step for the "first scale-out after the rise" figure.
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

from polyserve.shared.paths import datasets_dir  # also re-exported


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival (seconds from the first)."""

    name: str
    arrival: np.ndarray  # float64 seconds
    input_len: np.ndarray  # int64
    output_len: np.ndarray  # int64 (>= 1)
    step_s: float | None = None  # synthetic traces: when the load step (or ramp) starts
    predicted_class: np.ndarray | None = None  # a real predictor's class per request (workloads.load_muserve)
    class_bounds: tuple[int, ...] | None = None  # what those classes mean (token bounds)
    client: np.ndarray | None = None  # the sending client (tenant) per request, where the trace has one (ServeGen)

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
    """A trace's time field in seconds: a number (seconds, as BurstGPT's), or a date and time
    ("2023-11-16 18:17:03.9799600" as Azure's, seven fractional digits included; "T" allowed)."""
    ts = ts.strip()
    try:
        return float(ts)
    except ValueError:
        pass
    day, _, clock = ts.replace("T", " ").partition(" ")
    h, m, sec = clock.rstrip("Z").split(":")
    return date.fromisoformat(day).toordinal() * 86400.0 + int(h) * 3600 + int(m) * 60 + float(sec)


# Column names a CSV trace may use, compared lower-case without spaces, "_" or "-": Azure's (the
# first), BurstGPT's ("Timestamp", "Request tokens", "Response tokens") and the usual generic ones.
TIME_COLUMNS = ("TIMESTAMP", "arrival_time", "arrival_s", "arrival", "time")
INPUT_COLUMNS = ("ContextTokens", "Request tokens", "input_tokens", "prompt_tokens", "input_len", "input_length")
OUTPUT_COLUMNS = ("GeneratedTokens", "Response tokens", "output_tokens", "completion_tokens", "output_len",
                  "output_length")


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c not in " _-")


def _column(header: list[str], names: Sequence[str], what: str, path) -> str:
    """The header's column for `what`, by the first of `names` it has."""
    have = {_key(h): h for h in header}
    for n in names:
        if _key(n) in have:
            return have[_key(n)]
    raise ValueError(f"{path}: no {what} column; a CSV trace needs one of {', '.join(names)} "
                     f"(its header: {', '.join(header) or 'empty'})")


def load_azure_llm(path: str | Path) -> Trace:
    """A CSV request trace: Azure LLM inference's (TIMESTAMP, ContextTokens, GeneratedTokens), or
    any CSV with an arrival time, input and output token columns under the names `TIME_COLUMNS`,
    `INPUT_COLUMNS` and `OUTPUT_COLUMNS` list (e.g. BurstGPT's). A row whose output is 0 (a failed
    request in BurstGPT) counts as one token."""
    t, i, o = [], [], []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [h for h in (reader.fieldnames or []) if h is not None]
        cols = (_column(header, TIME_COLUMNS, "arrival time", path), _column(header, INPUT_COLUMNS, "input tokens", path),
                _column(header, OUTPUT_COLUMNS, "output tokens", path))
        for line, row in enumerate(reader, start=2):
            try:
                t.append(_seconds(row[cols[0]]))
                i.append(int(float(row[cols[1]])))
                o.append(int(float(row[cols[2]])))
            except (TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}, line {line}: cannot read {[row.get(c) for c in cols]} as "
                                 f"(time, input tokens, output tokens): {exc}") from None
            if i[-1] < 0 or o[-1] < 0:
                raise ValueError(f"{path}, line {line}: negative token count")
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
    step = None
    if trace.step_s is not None:
        step = (trace.step_s - a[mask][0]) / rate_scale
        if step < 0 or (duration_s is not None and step > duration_s) or (end_s is not None and trace.step_s >= end_s):
            step = None
    pc = trace.predicted_class[mask][keep] if trace.predicted_class is not None else None
    cl = trace.client[mask][keep] if trace.client is not None else None
    return Trace(trace.name + suffix, arr[keep], trace.input_len[mask][keep], trace.output_len[mask][keep], step,
                 pc, trace.class_bounds, cl)


# ------------------------------------------------------------------ synthetic load steps
SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_HELP = "synthetic:step:BASE:PEAK:AT_S:DURATION_S[:RAMP_S] (rates in req/s, times in s)"


def synthetic_step(base_rps: float, peak_rps: float, at_s: float, duration_s: float, lengths: Trace,
                   ramp_s: float = 0.0, seed: int = 0) -> Trace:
    """Poisson arrivals at `base_rps`, from `at_s` rising linearly over `ramp_s` (0 = a step)
    to `peak_rps`, kept until `duration_s`; (input, output) pairs drawn with replacement
    from `lengths` (module docstring). Non-homogeneous Poisson by thinning."""
    if base_rps < 0 or peak_rps <= 0 or (base_rps == 0 and peak_rps == 0):
        raise ValueError(f"synthetic step: need BASE >= 0 and PEAK > 0 req/s (got {base_rps:g}, {peak_rps:g})")
    if not 0 <= at_s < duration_s or ramp_s < 0 or at_s + ramp_s > duration_s:
        raise ValueError(f"synthetic step: need 0 <= AT_S < DURATION_S and AT_S + RAMP_S <= DURATION_S "
                         f"(got at {at_s:g}, ramp {ramp_s:g}, duration {duration_s:g})")
    if len(lengths) == 0:
        raise ValueError("synthetic step: the length trace is empty")
    rng = np.random.default_rng(seed)
    lam_max = max(base_rps, peak_rps)
    t = np.cumsum(rng.exponential(1.0 / lam_max, size=int(lam_max * duration_s * 1.2) + 64))
    while t[-1] < duration_s:  # (rare) not enough points drawn
        t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / lam_max, size=1024))])
    t = t[t < duration_s]
    frac = np.clip((t - at_s) / ramp_s, 0.0, 1.0) if ramp_s > 0 else (t >= at_s).astype(float)
    lam = base_rps + (peak_rps - base_rps) * frac
    t = t[rng.random(t.size) < lam / lam_max]
    if t.size == 0:
        raise ValueError("synthetic step: no arrivals; raise the rates or the duration")
    pick = rng.integers(0, len(lengths), size=t.size)
    name = f"step{base_rps:g}to{peak_rps:g}" + (f"ramp{ramp_s:g}" if ramp_s else "")
    # the trace starts at 0 (the generator's clock), not at the first arrival, so step_s stays AT_S
    return Trace(name, t, lengths.input_len[pick].copy(), lengths.output_len[pick].copy(), float(at_s))


def parse_synthetic(spec: str) -> dict:
    """The fields of a ``synthetic:step:...`` spec (see SYNTHETIC_HELP)."""
    parts = spec[len(SYNTHETIC_PREFIX):].split(":") if spec.startswith(SYNTHETIC_PREFIX) else []
    if not parts or parts[0] != "step" or len(parts) not in (5, 6):
        raise ValueError(f"bad synthetic trace {spec!r}; expected {SYNTHETIC_HELP}, e.g. synthetic:step:1:3:300:1200")
    try:
        vals = [float(x) for x in parts[1:]]
    except ValueError:
        raise ValueError(f"bad synthetic trace {spec!r}: every field after 'step' must be a number "
                         f"({SYNTHETIC_HELP})") from None
    keys = ("base_rps", "peak_rps", "at_s", "duration_s", "ramp_s")
    return dict(zip(keys, vals))


def load_trace(spec: str | Path, lengths_path: str | Path | None = None, seed: int = 0) -> Trace:
    """An Azure CSV path, a Mooncake ``.jsonl``, a ``servegen:``/``muserve:`` spec
    (`simulator.workloads`), or a synthetic spec; lengths that a spec lacks come from
    `lengths_path` (an Azure CSV)."""
    from polyserve.simulator import workloads

    s = str(spec)
    src = lengths_path or datasets_dir() / "traces" / "azure_llm_2023_conv.csv"
    if s.startswith("servegen:"):
        return workloads.load_servegen(s, load_azure_llm(src), seed=seed)
    if s.startswith("muserve:"):
        return workloads.load_muserve(s, load_azure_llm(src), seed=seed)
    if s.endswith(".jsonl"):
        return workloads.load_mooncake(s)
    if not s.startswith(SYNTHETIC_PREFIX):
        return load_azure_llm(s)
    kw = parse_synthetic(s)
    return synthetic_step(lengths=load_azure_llm(src), seed=seed, **kw)


def write_azure_csv(trace: Trace, path: str | Path, t0: str = "2023-11-16 18:00:00") -> Path:
    """Write `trace` in the Azure LLM CSV format (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    from datetime import datetime, timedelta

    start = datetime.fromisoformat(t0)
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for a, i, o in zip(trace.arrival.tolist(), trace.input_len.tolist(), trace.output_len.tolist()):
            w.writerow([(start + timedelta(seconds=a)).strftime("%Y-%m-%d %H:%M:%S.%f"), i, o])
    return path


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
