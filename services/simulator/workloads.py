"""More request traces for the simulator (beside the Azure CSVs of `trace`).

* Mooncake (``*.jsonl`` with ``timestamp`` ms, ``input_length``, ``output_length``): the
  FAST'25 synthetic long-context trace (mean prompt 15k tokens, mean output 149).
* ServeGen (``servegen:DIR[:START_S[:DURATION_S]]``, DIR a folder of
  ``chunk-<client>-trace.csv`` files, e.g. ``.../servegen/reason/deepseek-r1``): Alibaba's
  per-client arrival *statistics*, not logs. Every client's 10-minute windows give a mean
  rate, a CV and a fitted inter-arrival family (Gamma or Weibull); arrivals are drawn per
  client from that family with the window's CV, scaled to the window's mean rate, and
  the clients summed. Lengths come from the client's ``chunk-<client>-dataset.json``
  (input/output PMFs per 6-hour window) where the folder has them (reason; multimodal, whose
  prompt is its text, image, audio and video tokens summed: `_input_draw`);
  otherwise (language: those files were not published here) each arrival takes an
  (input, output) pair drawn from `lengths` (the Azure conv trace by default).
* µ-Serve's published predictions (``muserve:CSV[:RATE]``, the SSJF repo's
  ``predictions_warmup_multi_cls_1000K.csv``): vicuna-13b's true output length on
  LMSYS-Chat prompts and the class the SSJF proxy model predicted for each, in file
  order. The file holds no arrival times and no prompt lengths: arrivals are Poisson at
  RATE req/s (default 1) and prompt lengths are drawn from `lengths`. The predicted
  classes travel with the trace (`Trace.predicted_class`, `Trace.class_bounds`) for
  ``--predictor real``.
"""
from __future__ import annotations

import ast
import csv
import json
import math
from pathlib import Path

import numpy as np

from polyserve.simulator.trace import Trace

MUSERVE_BOUNDS = (59, 148, 281, 500)
"""µ-Serve's SSJF buckets (≤58, ≤147, ≤280, ≤499, more tokens) as class bounds k: bounds[k-1] <= L < bounds[k]."""
WINDOW_S = 600.0


def load_mooncake(path: str | Path) -> Trace:
    """A Mooncake JSONL trace (timestamp in ms)."""
    t, i, o = [], [], []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                    t.append(float(row["timestamp"]) / 1000.0)
                    i.append(int(row["input_length"]))
                    o.append(int(row["output_length"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}, line {n}: a Mooncake trace line is a JSON object with timestamp "
                                     f"(ms), input_length and output_length ({type(exc).__name__}: {exc})") from None
    if not t:
        raise ValueError(f"{path}: no requests")
    arr = np.asarray(t)
    order = np.argsort(arr, kind="stable")
    return Trace(Path(path).stem, arr[order] - arr[order][0], np.asarray(i, dtype=np.int64)[order],
                 np.maximum(1, np.asarray(o, dtype=np.int64)[order]))


def _gaps(rng: np.random.Generator, family: str, cv: float, rate: float, n: int) -> np.ndarray:
    """`n` inter-arrival gaps of mean 1/rate and the given CV, from the named family (the
    fitted shape's CV is used, the scale set by the window's rate; Poisson when unknown)."""
    cv = cv if cv > 0 and math.isfinite(cv) else 1.0
    if family == "Gamma":
        k = 1.0 / (cv * cv)
        g = rng.gamma(k, 1.0, size=n)
    elif family == "Weibull":  # shape from the CV (bisection on CV(k), decreasing in k)
        lo, hi = 0.05, 20.0
        for _ in range(50):
            k = (lo + hi) / 2
            m1, m2 = math.gamma(1 + 1 / k), math.gamma(1 + 2 / k)
            if math.sqrt(max(m2 / (m1 * m1) - 1, 0.0)) > cv:
                lo = k
            else:
                hi = k
        g = rng.weibull(k, size=n)
    else:
        g = rng.exponential(1.0, size=n)
    return g / max(g.mean(), 1e-12) / rate if n > 1 else g / max(float(g.mean()), 1e-12) / rate


def _pmf_draw(rng: np.random.Generator, text: str, n: int) -> np.ndarray:
    pmf = ast.literal_eval(text) if isinstance(text, str) else text
    vals = np.asarray(list(pmf.keys()), dtype=np.int64)
    p = np.asarray(list(pmf.values()), dtype=float)
    return rng.choice(vals, size=n, p=p / p.sum())


MODALITY_TOKENS = ("text_tokens", "image_tokens", "audio_tokens", "video_tokens")
"""A multimodal window's prompt parts (ServeGen's mm-image datasets): its prompt is their sum."""


def _input_draw(rng: np.random.Generator, window: dict, n: int, path: Path) -> np.ndarray:
    """`n` prompt lengths from a dataset window: its ``input_tokens`` PMF (language, reason), or
    (multimodal) the sum of one draw from each of the text, image, audio and video token PMFs it
    has: every modality's tokens are prompt tokens the engine prefills. The image PMF is taken as
    a request's image tokens in all (ServeGen publishes it beside ``image_count``; a window of
    2.8 images on average has 367 image tokens on average, so it is not per image)."""
    if "input_tokens" in window:
        return _pmf_draw(rng, window["input_tokens"], n)
    parts = [k for k in MODALITY_TOKENS if k in window]
    if not parts or "output_tokens" not in window:
        raise ValueError(f"servegen: {path} has a window with neither input_tokens nor text/image/audio/video "
                         f"token PMFs and output_tokens (it has: {', '.join(sorted(window))})")
    return sum((_pmf_draw(rng, window[k], n) for k in parts), np.zeros(n, dtype=np.int64))


def load_servegen(spec: str, lengths: Trace | None, seed: int = 0) -> Trace:
    """``servegen:DIR[:START_S[:DURATION_S]]`` (module docstring); default start 0, one hour."""
    parts = spec[len("servegen:"):].split(":")
    folder = Path(parts[0])
    start = float(parts[1]) if len(parts) > 1 and parts[1] else 0.0
    duration = float(parts[2]) if len(parts) > 2 and parts[2] else 3600.0
    files = sorted(folder.glob("chunk-*-trace.csv"))
    if not files:
        raise ValueError(f"servegen: no chunk-*-trace.csv under {folder}")
    rng = np.random.default_rng(seed)
    t_all, i_all, o_all, c_all = [], [], [], []
    for f_no, f in enumerate(files):
        ds_path = f.with_name(f.name.replace("-trace.csv", "-dataset.json"))
        ds = json.loads(ds_path.read_text()) if ds_path.exists() else None
        with open(f, newline="") as fh:
            for row in csv.reader(fh):
                w0, rate = float(row[0]), float(row[1] or 0)
                if rate <= 0 or w0 + WINDOW_S <= start or w0 >= start + duration:
                    continue
                n = max(1, int(rate * WINDOW_S * 1.5) + 8)
                t = w0 + rng.uniform(0, 1) / rate + np.cumsum(_gaps(rng, row[3], float(row[2] or 1), rate, n))
                t = t[(t < w0 + WINDOW_S) & (t >= start) & (t < start + duration)]
                if t.size == 0:
                    continue
                t_all.append(t)
                c_all.append(np.full(t.size, f_no, dtype=np.int64))
                if ds:  # the dataset window (6 h) that holds this arrival window
                    key = max((k for k in ds if float(k) <= w0), key=float, default=min(ds, key=float))
                    i_all.append(_input_draw(rng, ds[key], t.size, ds_path))
                    o_all.append(_pmf_draw(rng, ds[key]["output_tokens"], t.size))
                else:
                    if lengths is None:
                        raise ValueError(f"servegen: {folder} has no dataset.json; give a trace to draw lengths from")
                    pick = rng.integers(0, len(lengths), size=t.size)
                    i_all.append(lengths.input_len[pick])
                    o_all.append(lengths.output_len[pick])
    if not t_all:
        raise ValueError(f"servegen: no arrivals in [{start:g}, {start + duration:g}) s under {folder}")
    t = np.concatenate(t_all)
    order = np.argsort(t, kind="stable")
    name = f"servegen-{folder.parent.name}-{folder.name}"
    return Trace(name, t[order] - t[order][0], np.concatenate(i_all).astype(np.int64)[order],
                 np.maximum(1, np.concatenate(o_all).astype(np.int64)[order]),
                 client=np.concatenate(c_all)[order])


def load_muserve(spec: str, lengths: Trace | None, seed: int = 0) -> Trace:
    """``muserve:CSV[:RATE]`` (module docstring): true lengths and µ-Serve's predicted classes."""
    body = spec[len("muserve:"):]
    path, _, rate_s = body.rpartition(":") if body.count(":") and _is_number(body.rpartition(":")[2]) \
        else (body, "", "")
    rate = float(rate_s) if rate_s else 1.0
    if rate <= 0:
        raise ValueError("muserve: RATE must be > 0 req/s")
    out, pred = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out.append(int(row["output_token_length"]))
            pred.append(int(row["predicted_length"]))
    if not out:
        raise ValueError(f"{path}: no rows")
    rng = np.random.default_rng(seed)
    arr = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, size=len(out) - 1))])
    if lengths is None:
        raise ValueError("muserve: give a trace to draw prompt lengths from")
    inp = lengths.input_len[rng.integers(0, len(lengths), size=len(out))]
    return Trace("muserve-lmsys-vicuna13b", arr, inp.astype(np.int64), np.maximum(1, np.asarray(out, dtype=np.int64)),
                 predicted_class=np.asarray(pred, dtype=np.int64), class_bounds=MUSERVE_BOUNDS)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
