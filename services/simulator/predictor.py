"""Output-length predictors for the simulator.

* ``oracle``: the true length and its class.
* ``confusion``: the true length's class is mapped to a predicted class by drawing from a
  row of a confusion matrix (rows: true class, columns: predicted class; JSON list of
  lists, each row summing to 1); the predicted token count is the mean true length of the
  predicted class in the trace. `DEFAULT_CONFUSION` is synthetic, not measured: an
  ordinal 5-class matrix chosen to match what µ-Serve reports for its ordinal predictor
  (§4.3, Table 2: accuracy 0.43, mean class error L1 0.76) — accuracy 0.44 and L1 ≈ 0.72
  under percentile classes, with the mass on neighbouring classes. Pass a measured matrix
  (e.g. the project's predictor evaluated on held-out data) with ``--confusion``.
* ``history``: Aladdin's conditional mean by input-length bucket
  (`polyserve.predictor.policy.estimate`), learning true lengths online as requests complete.

Classes follow µ-Serve §3.3: bounds at the 25th, 50th, 75th and 99th percentiles of the
trace's output lengths (``percentile``), or explicit bounds such as the live predictor's
``32,128,256,512``.
"""
from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from polyserve.predictor import policy as pp

DEFAULT_CONFUSION: list[list[float]] = [
    [0.50, 0.33, 0.11, 0.05, 0.01],
    [0.22, 0.43, 0.25, 0.09, 0.01],
    [0.08, 0.24, 0.40, 0.24, 0.04],
    [0.03, 0.11, 0.28, 0.42, 0.16],
    [0.01, 0.04, 0.15, 0.45, 0.35],
]
MODES = ("oracle", "confusion", "history")


def percentile_bounds(output_len: np.ndarray) -> tuple[int, ...]:
    """µ-Serve's class bounds: p25, p50, p75, p99 of the output lengths (strictly increasing)."""
    qs = np.percentile(output_len, [25, 50, 75, 99])
    out: list[int] = []
    for q in qs:
        b = int(np.ceil(q))
        out.append(max(b, out[-1] + 1) if out else max(1, b))
    return tuple(out)


def load_confusion(path: str | Path | None) -> np.ndarray:
    """A confusion matrix from JSON (default `DEFAULT_CONFUSION`), rows normalised."""
    m = np.asarray(json.loads(Path(path).read_text()) if path else DEFAULT_CONFUSION, dtype=float)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or (m < 0).any() or (m.sum(axis=1) <= 0).any():
        raise ValueError(f"confusion matrix must be square, non-negative, rows > 0; got shape {m.shape}")
    return m / m.sum(axis=1, keepdims=True)


class ConditionalMean:
    """E[L | L > g] from a sample of output lengths: Aladdin's re-prediction (§4.3) for a
    request that has outlived its prediction. Callable as `AladdinConfig.repredict`."""

    def __init__(self, output_len: np.ndarray):
        srt = np.sort(np.asarray(output_len, dtype=float))
        suffix = np.cumsum(srt[::-1])[::-1]
        self._sorted = srt.tolist()
        self._suffix = suffix.tolist()
        self._memo: dict[int, int] = {}

    def __call__(self, input_tokens: int, predicted: int, generated: int) -> int:
        got = self._memo.get(generated)
        if got is None:
            k = bisect_right(self._sorted, generated)
            n = len(self._sorted) - k
            got = generated + 1 if n <= 0 else max(generated + 1, int(round(self._suffix[k] / n)))
            self._memo[generated] = got
        return got


class LengthPredictor:
    """Predicted tokens and class of each request (see the module docstring)."""

    def __init__(self, mode: str, output_len: np.ndarray, *, bounds: Sequence[int] | None = None,
                 confusion: np.ndarray | None = None, seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"predictor {mode!r} is unknown; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.bounds = tuple(bounds) if bounds else percentile_bounds(output_len)
        self.num_classes = len(self.bounds) + 1
        true_cls = np.searchsorted(np.asarray(self.bounds), output_len, side="right")
        means = [float(output_len[true_cls == k].mean()) if (true_cls == k).any() else float(b)
                 for k, b in enumerate((*self.bounds, self.bounds[-1] * 2))]
        self.class_tokens = np.maximum(1, np.round(means)).astype(np.int64)
        self.confusion = confusion if confusion is not None else load_confusion(None)
        if mode == "confusion" and self.confusion.shape[0] != self.num_classes:
            raise ValueError(f"confusion matrix is {self.confusion.shape[0]}x{self.confusion.shape[0]} "
                             f"but there are {self.num_classes} classes")
        self.seed = seed
        self.stats = pp.ModelStats()

    def precompute(self, output_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(predicted tokens, predicted class) per request; history mode fills them at arrival
        (tokens 0 here, see `predict_online`)."""
        true_cls = np.searchsorted(np.asarray(self.bounds), output_len, side="right")
        if self.mode == "oracle":
            return output_len.astype(np.int64).copy(), true_cls.astype(np.int64)
        if self.mode == "confusion":
            rng = np.random.default_rng(self.seed + 7)
            cum = np.cumsum(self.confusion, axis=1)
            u = rng.random(output_len.size)
            pred = (u[:, None] > cum[true_cls]).sum(axis=1).clip(0, self.num_classes - 1)
            return self.class_tokens[pred].copy(), pred.astype(np.int64)
        return np.zeros(output_len.size, dtype=np.int64), np.full(output_len.size, -1, dtype=np.int64)

    def predict_online(self, input_tokens: int) -> tuple[int, int]:
        """History mode: Aladdin's conditional mean from what has completed so far."""
        est = pp.estimate(self.stats, input_tokens, bounds=self.bounds)
        return est.tokens, est.length_class

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        """History mode: learn a completed request's true length."""
        self.stats = pp.observe(self.stats, input_tokens, output_tokens)


class GivenPredictions:
    """Predictions fixed in advance (e.g. what the live predictor said for each request)."""

    mode = "given"

    def __init__(self, tokens: np.ndarray, classes: np.ndarray | None = None):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.classes = np.full(self.tokens.size, -1, dtype=np.int64) if classes is None else np.asarray(classes)

    def precompute(self, output_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens.copy(), self.classes.copy()

