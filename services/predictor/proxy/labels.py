"""Ordinal length classes and the metrics of µ-Serve's Table 2 (pure, numpy only).

µ-Serve §3.3: per target model, the percentiles p25, p50, p75 and p99 of the
output lengths of its *training* answers split lengths into five classes
``[0, p25), [p25, p50), [p50, p75), [p75, p99), [p99, inf)`` numbered 0..4. The
predictor outputs a real value trained towards the class index; inference
rounds it to the nearest class, and the token estimate of a class is the median
training length inside it.

Bounds are kept strictly increasing: when percentiles tie (many answers of the
same length), a tied bound is moved up by one token so that every class has a
non-empty range of lengths (it may still hold no training sample).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from polyserve.core.length_classes import unseen_scheme

PERCENTILES: tuple[float, ...] = (25.0, 50.0, 75.0, 99.0)
NUM_CLASSES = len(PERCENTILES) + 1


def percentile_bounds(lengths: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> tuple[float, ...]:
    """Strictly increasing class bounds at `percentiles` of `lengths` (ValueError when empty)."""
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("cannot compute class bounds of no lengths")
    raw = [float(x) for x in np.percentile(arr, list(percentiles))]
    bounds: list[float] = []
    for b in raw:
        if bounds and b <= bounds[-1]:
            b = bounds[-1] + 1.0
        bounds.append(b)
    return tuple(bounds)


def classes_of(lengths: Sequence[float] | np.ndarray, bounds: Sequence[float]) -> np.ndarray:
    """Class of each length: k such that bounds[k-1] <= length < bounds[k]."""
    return np.searchsorted(np.asarray(bounds, dtype=np.float64), np.asarray(lengths, dtype=np.float64),
                           side="right").astype(np.int64)


def class_of(length: float, bounds: Sequence[float]) -> int:
    """Class of one length."""
    return int(classes_of([length], bounds)[0])


def round_to_class(values: Sequence[float] | np.ndarray, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """Nearest class of real-valued predictions (halves round up), clipped to 0..num_classes-1."""
    v = np.floor(np.asarray(values, dtype=np.float64) + 0.5)
    return np.clip(v, 0, num_classes - 1).astype(np.int64)


def class_medians(lengths: Sequence[float], bounds: Sequence[float]) -> tuple[float, ...]:
    """Median training length inside each class; an empty class gets the middle of its range."""
    arr = np.asarray(lengths, dtype=np.float64)
    cls = classes_of(arr, bounds)
    edges = [0.0, *bounds]
    out = []
    for k in range(len(bounds) + 1):
        members = arr[cls == k]
        if members.size:
            out.append(float(np.median(members)))
        elif k < len(bounds):
            out.append((edges[k] + edges[k + 1]) / 2)
        else:
            out.append(float(bounds[-1]) * 1.5)  # above p99 with no sample: a guess, documented
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ModelClasses:
    """Class bounds and per-class median lengths of one target model."""

    bounds: tuple[float, ...]
    medians: tuple[float, ...]
    count: int = 0  # training answers they were computed from

    @classmethod
    def fit(cls, lengths: Sequence[float]) -> "ModelClasses":
        bounds = percentile_bounds(lengths)
        return cls(bounds, class_medians(lengths, bounds), len(lengths))

    @classmethod
    def unseen(cls, known: Sequence["ModelClasses"]) -> "ModelClasses":
        """Classes for a model not in training: per class, the geometric mean over the known
        models of their bounds and medians, each model weighted equally
        (`polyserve.core.length_classes.unseen_scheme`)."""
        bounds, medians = unseen_scheme([(k.bounds, k.medians) for k in known])
        return cls(bounds, medians, sum(k.count for k in known))

    @property
    def num_classes(self) -> int:
        return len(self.bounds) + 1

    def classes(self, lengths: Sequence[float] | np.ndarray) -> np.ndarray:
        return classes_of(lengths, self.bounds)

    def tokens(self, length_class: int) -> int:
        """Token estimate of a class: its median training length (at least 1)."""
        k = min(max(int(length_class), 0), self.num_classes - 1)
        return max(1, int(round(self.medians[k])))

    def to_json(self) -> dict:
        return {"bounds": list(self.bounds), "medians": list(self.medians), "count": self.count}

    @classmethod
    def from_json(cls, d: Mapping) -> "ModelClasses":
        bounds = tuple(float(b) for b in d["bounds"])
        medians = tuple(float(m) for m in d["medians"])
        if len(medians) != len(bounds) + 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"invalid class bounds {bounds} / medians {medians}")
        return cls(bounds, medians, int(d.get("count", 0)))


# ------------------------------------------------------------------------ metrics
def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    return float(np.mean(y_true == y_pred)) if y_true.size else math.nan


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Unweighted mean F1 over the classes present in `y_true` or `y_pred` (as scikit-learn's 'macro')."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if not y_true.size:
        return math.nan
    scores = []
    for k in np.union1d(y_true, y_pred):
        tp = float(np.sum((y_pred == k) & (y_true == k)))
        fp = float(np.sum((y_pred == k) & (y_true != k)))
        fn = float(np.sum((y_pred != k) & (y_true == k)))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


def kendall_tau(values: np.ndarray, lengths: np.ndarray) -> float:
    """Kendall's tau-b between predicted values and true lengths (nan when either is constant)."""
    from scipy.stats import kendalltau

    values, lengths = np.asarray(values, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    if values.size < 2 or np.all(values == values[0]) or np.all(lengths == lengths[0]):
        return math.nan
    return float(kendalltau(values, lengths).statistic)


def scores(y_true: np.ndarray, y_pred: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """Table-2 metrics: accuracy, macro-F1, L1 and MSE in class units, Kendall's tau (value vs length)."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    diff = (y_pred - y_true).astype(np.float64)
    return {
        "n": int(y_true.size),
        "accuracy": accuracy(y_true, y_pred),
        "macro_f1": macro_f1(y_true, y_pred),
        "l1": float(np.mean(np.abs(diff))) if diff.size else math.nan,
        "mse": float(np.mean(diff ** 2)) if diff.size else math.nan,
        "kendall_tau": kendall_tau(values, lengths),
    }


def mean_group_tau(groups: Sequence[str], values: np.ndarray, lengths: np.ndarray) -> float:
    """Row-weighted mean over groups (target models) of Kendall's tau within each group.

    A ranking is only used within one model's queue, and values of different
    models are in their own class units, so taus are computed per model."""
    names = np.asarray(groups)
    values, lengths = np.asarray(values), np.asarray(lengths)
    total, weight = 0.0, 0
    for g in np.unique(names):
        sel = names == g
        t = kendall_tau(values[sel], lengths[sel])
        if not math.isnan(t):
            total += t * int(sel.sum())
            weight += int(sel.sum())
    return total / weight if weight else math.nan
