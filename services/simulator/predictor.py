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
  Default matrix (`resolve_confusion`): the shipped predictor's measured
  out-of-distribution confusion, key ``ood_confusion`` of the shipped artifact's metadata
  (``polyserve/predictor/artifacts/<lexical-gbm|proxy-minilm>/meta.json``, found on disk without
  importing the predictor service; or ``--confusion FILE`` / ``$POLYSERVE_PREDICTOR_META``
  naming a metadata JSON or a bare matrix). Where the key is absent, `DEFAULT_CONFUSION`
  is used and the run's predictor name says so.
* ``real``: the predictions a trace carries (`Trace.predicted_class`, e.g. µ-Serve's
  published SSJF predictions on LMSYS-Chat, `workloads.load_muserve`), classes with the
  trace's bounds; tokens as in ``confusion``.
* ``history``: Aladdin's conditional mean by input-length bucket (the predictor's rule,
  restated here from `polyserve.core.length_hint` so no service is imported), learning
  true lengths online as requests complete.

Token estimate of a predicted class (``estimate``): ``class_mean`` (the mean true length
of that class in the trace, as if the prediction were right: what a predictor that
answers its class's typical length gives) or ``posterior`` (E[L | predicted class], the
per-class conditional mean of the true length given the prediction, which shrinks
towards the middle as much as the predictor errs).

Classes follow µ-Serve §3.3: bounds at the 25th, 50th, 75th and 99th percentiles of the
trace's output lengths for 5 classes (``percentile``; p25/p50/p75 for 4, evenly spaced
otherwise), or explicit bounds such as the live predictor's ``32,128,256,512``.
"""
from __future__ import annotations

import importlib.util
import json
import os
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from polyserve.core.length_hint import MIN_SAMPLES, PRIOR_TOKENS, bucket_of, length_class

DEFAULT_CONFUSION: list[list[float]] = [
    [0.50, 0.33, 0.11, 0.05, 0.01],
    [0.22, 0.43, 0.25, 0.09, 0.01],
    [0.08, 0.24, 0.40, 0.24, 0.04],
    [0.03, 0.11, 0.28, 0.42, 0.16],
    [0.01, 0.04, 0.15, 0.45, 0.35],
]
MODES = ("oracle", "confusion", "history", "real")
ESTIMATES = ("class_mean", "posterior")
META_ENV = "POLYSERVE_PREDICTOR_META"
SHIPPED_ARTIFACTS = ("lexical-gbm", "proxy-minilm")
"""The predictor's artifacts in the package, its default ("shipped") first."""


def shipped_meta_path() -> Path | None:
    """The shipped predictor artifact's meta.json (`$POLYSERVE_PREDICTOR_META`, else the first of
    `SHIPPED_ARTIFACTS` present), located on disk without importing the predictor service."""
    env = os.environ.get(META_ENV)
    if env:
        return Path(env)
    spec = importlib.util.find_spec("polyserve.predictor")
    for name in SHIPPED_ARTIFACTS:
        for loc in (spec.submodule_search_locations or []) if spec else []:
            p = Path(loc) / "artifacts" / name / "meta.json"
            if p.exists():
                return p
    return None


def resolve_confusion(path: str | Path | None) -> tuple[np.ndarray, str]:
    """(row-normalised matrix, its name for the report): `path` (a bare matrix, a metadata
    JSON with ``ood_confusion`` or a folder holding meta.json), else the shipped artifact's
    ``ood_confusion``, else `DEFAULT_CONFUSION` (named as a fallback)."""
    if path:
        p = Path(path)
        p = p / "meta.json" if p.is_dir() else p
        data = json.loads(p.read_text())
        if isinstance(data, dict):
            if data.get("ood_confusion") is None:
                raise ValueError(f"{p}: no 'ood_confusion' matrix (give a matrix or a metadata JSON that has one)")
            return load_confusion(data["ood_confusion"]), f"measured OOD confusion of {p}"
        return load_confusion(data), f"confusion matrix from {p}"
    meta = shipped_meta_path()
    if meta is not None and meta.exists():
        data = json.loads(meta.read_text())
        if data.get("ood_confusion") is not None:
            return load_confusion(data["ood_confusion"]), f"shipped predictor's measured OOD confusion ({meta})"
        why = f"{meta} has no 'ood_confusion' matrix"  # absent, or null while being re-recorded
    else:
        why = "shipped predictor artifact not found"
    return load_confusion(None), (f"FALLBACK synthetic µ-Serve-like 5-class confusion (simulator.predictor."
                                  f"DEFAULT_CONFUSION, accuracy ~0.44; {why})")


def percentile_bounds(output_len: np.ndarray, classes: int = 5) -> tuple[int, ...]:
    """µ-Serve's class bounds: p25, p50, p75, p99 of the output lengths for 5 classes; p25/p50/p75
    for 4; evenly spaced percentiles otherwise (strictly increasing)."""
    pcts = {5: [25, 50, 75, 99], 4: [25, 50, 75]}.get(classes, list(np.linspace(0, 100, classes + 1)[1:-1]))
    qs = np.percentile(output_len, pcts)
    out: list[int] = []
    for q in qs:
        b = int(np.ceil(q))
        out.append(max(b, out[-1] + 1) if out else max(1, b))
    return tuple(out)


def load_confusion(src) -> np.ndarray:
    """A confusion matrix from a JSON file, a list of rows, or None (`DEFAULT_CONFUSION`), rows normalised."""
    if src is None:
        src = DEFAULT_CONFUSION
    elif isinstance(src, (str, Path)):
        src = json.loads(Path(src).read_text())
    m = np.asarray(src, dtype=float)
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
                 confusion: np.ndarray | None = None, seed: int = 0, estimate: str = "class_mean",
                 given_classes: np.ndarray | None = None, name: str = ""):
        if mode not in MODES:
            raise ValueError(f"predictor {mode!r} is unknown; choose one of {', '.join(MODES)}")
        if estimate not in ESTIMATES:
            raise ValueError(f"estimate {estimate!r} is unknown; choose one of {', '.join(ESTIMATES)}")
        if mode == "real" and (given_classes is None or bounds is None):
            raise ValueError("predictor 'real' needs a trace that carries predictions (e.g. muserve:CSV)")
        self.mode, self.estimate, self.seed = mode, estimate, seed
        self.confusion = confusion if confusion is not None else load_confusion(None)
        k = self.confusion.shape[0] if mode == "confusion" else 5
        self.bounds = tuple(bounds) if bounds else percentile_bounds(output_len, k)
        self.num_classes = len(self.bounds) + 1
        if mode == "confusion" and self.confusion.shape[0] != self.num_classes:
            raise ValueError(f"confusion matrix is {self.confusion.shape[0]}x{self.confusion.shape[0]} "
                             f"but there are {self.num_classes} classes")
        self.given_classes = given_classes
        self.name = name or mode
        true_cls = np.searchsorted(np.asarray(self.bounds), output_len, side="right")
        means = [float(output_len[true_cls == c].mean()) if (true_cls == c).any() else float(b)
                 for c, b in enumerate((*self.bounds, self.bounds[-1] * 2))]
        self.class_tokens = np.maximum(1, np.round(means)).astype(np.int64)
        self._hist: dict[int, list[int]] = {}

    def _tokens_of(self, pred: np.ndarray, output_len: np.ndarray) -> np.ndarray:
        """Token estimate per predicted class: the class's mean, or E[L | predicted class]."""
        if self.estimate == "class_mean":
            return self.class_tokens[pred].copy()
        sums = np.bincount(pred, weights=output_len, minlength=self.num_classes)
        counts = np.bincount(pred, minlength=self.num_classes)
        post = np.where(counts > 0, sums / np.maximum(counts, 1), self.class_tokens)
        return np.maximum(1, np.round(post)).astype(np.int64)[pred]

    def precompute(self, output_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(predicted tokens, predicted class) per request; history mode fills them at arrival
        (tokens 0 here, see `predict_online`)."""
        true_cls = np.searchsorted(np.asarray(self.bounds), output_len, side="right")
        if self.mode == "oracle":
            return output_len.astype(np.int64).copy(), true_cls.astype(np.int64)
        if self.mode == "real":
            if len(self.given_classes) != output_len.size:
                raise ValueError(f"predictor 'real' holds {len(self.given_classes)} predictions for "
                                 f"{output_len.size} requests: build it from the trace that is run")
            pred = np.asarray(self.given_classes, dtype=np.int64).clip(0, self.num_classes - 1)
            return self._tokens_of(pred, output_len), pred
        if self.mode == "confusion":
            rng = np.random.default_rng(self.seed + 7)
            cum = np.cumsum(self.confusion, axis=1)
            u = rng.random(output_len.size)
            pred = (u[:, None] > cum[true_cls]).sum(axis=1).clip(0, self.num_classes - 1)
            return self._tokens_of(pred, output_len), pred.astype(np.int64)
        return np.zeros(output_len.size, dtype=np.int64), np.full(output_len.size, -1, dtype=np.int64)

    def predict_online(self, input_tokens: int) -> tuple[int, int]:
        """History mode: the mean output of completed requests in the same input bucket, else
        of all, else the prior (the predictor's rule, `core.length_hint`)."""
        one = self._hist.get(bucket_of(input_tokens), [0, 0])
        overall = [sum(c for c, _ in self._hist.values()), sum(t for _, t in self._hist.values())]
        tokens = PRIOR_TOKENS
        for count, total in (one, overall):
            if count >= MIN_SAMPLES:
                tokens = max(1, round(total / count))
                break
        return tokens, length_class(tokens, self.bounds)

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        """History mode: learn a completed request's true length."""
        s = self._hist.setdefault(bucket_of(input_tokens), [0, 0])
        s[0] += 1
        s[1] += int(output_tokens)


class GivenPredictions:
    """Predictions fixed in advance (e.g. what the live predictor said for each request)."""

    mode = "given"

    def __init__(self, tokens: np.ndarray, classes: np.ndarray | None = None):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.classes = np.full(self.tokens.size, -1, dtype=np.int64) if classes is None else np.asarray(classes)

    def precompute(self, output_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens.copy(), self.classes.copy()

