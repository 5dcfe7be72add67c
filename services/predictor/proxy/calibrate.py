"""Per-target class decoding for the fast tier (issue 17): a prediction's class is its rank among
the target model's recent predictions.

A length class is relative to the target model (its own p25/p50/p75/p99), so four in ten of a
model's requests should land in classes 0-1 and so on, whatever the traffic. Fixed cut points on
the predicted score (fitted on the training sets' validation rows) do not give that on traffic
unlike the training mix: a prompt set the score finds "short" on average gets mostly classes 0-1
and accuracy falls, though the order (tau) is right. `RankCalibrator` keeps, per target model,
the last `window` predicted scores and decodes a new score by its rank *level* among them (0..1),
cut at `level_cuts`: levels fitted on the validation rows to maximise accuracy against each
(prompt set, model) group's own classes (`fit_level_cuts`). A model it has seen few predictions of
leans on the validation distribution (`prior` pseudo-observations at the validation CDF), so the
first requests of a new model are decoded as with fixed cuts and the model's own traffic takes over
as it comes. No labels are needed: only the predictions it made.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, defaultdict, deque

import numpy as np

from polyserve.core.model_names import canonical

DEFAULT_WINDOW = 2000
DEFAULT_PRIOR = 20.0


def group_levels(keys: list, values: np.ndarray) -> np.ndarray:
    """Rank level (0..1, ties averaged) of each value within its group (`keys[i]`)."""
    from scipy.stats import rankdata

    by: dict = defaultdict(list)
    for i, k in enumerate(keys):
        by[k].append(i)
    out = np.zeros(len(values), dtype=np.float64)
    for idx in by.values():
        out[idx] = (rankdata(values[idx]) - 0.5) / len(idx)
    return out


def fit_level_cuts(keys: list, values: np.ndarray, truth: np.ndarray,
                   start: tuple[float, ...] = (0.25, 0.5, 0.75, 0.99)) -> tuple[float, ...]:
    """Level cut points maximising accuracy of (within-group level -> class) against `truth`."""
    from polyserve.predictor.proxy.lexical import accuracy_cuts

    return tuple(float(c) for c in accuracy_cuts(group_levels(keys, values), truth, start))


class RankCalibrator:
    """Per target model: recent predicted scores; a score's class is its rank level among them.

    `reference` is a sorted sample of validation scores (the prior CDF); `prior` is how many
    observations it counts as. At most `max_models` models are tracked (least recently used out)."""

    def __init__(self, level_cuts, reference, *, window: int = DEFAULT_WINDOW, prior: float = DEFAULT_PRIOR,
                 max_models: int = 1024):
        self.level_cuts = np.asarray(level_cuts, dtype=np.float64)
        self.reference = np.sort(np.asarray(reference, dtype=np.float64))
        self.window = int(window)
        self.prior = float(prior)
        self.max_models = int(max_models)
        self._recent: OrderedDict[str, tuple[deque, list]] = OrderedDict()

    def _ref_level(self, v: float) -> float:
        r = self.reference
        if not len(r):
            return 0.5
        lo, hi = bisect.bisect_left(r, v), bisect.bisect_right(r, v)
        return (lo + hi) / 2 / len(r)

    def level(self, model: str, value: float) -> float:
        """Rank level of `value` among the model's recent scores, shrunk towards the reference."""
        key = canonical(model)
        entry = self._recent.get(key)
        n = len(entry[1]) if entry else 0
        below = 0.0
        if n:
            s = entry[1]
            below = (bisect.bisect_left(s, value) + bisect.bisect_right(s, value)) / 2
        return (below + self.prior * self._ref_level(value)) / (n + self.prior)

    def observe(self, model: str, value: float) -> None:
        key = canonical(model)
        entry = self._recent.get(key)
        if entry is None:
            entry = self._recent[key] = (deque(), [])
            while len(self._recent) > self.max_models:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(key)
        order, srt = entry
        order.append(value)
        bisect.insort(srt, value)
        if len(order) > self.window:
            old = order.popleft()
            del srt[bisect.bisect_left(srt, old)]

    def classify(self, model: str, value: float, *, learn: bool = True) -> int:
        """The class of `value` for `model` (then remembered, unless `learn` is False)."""
        c = int(np.searchsorted(self.level_cuts, self.level(model, value), side="right"))
        if learn:
            self.observe(model, value)
        return c

    def to_json(self) -> dict:
        return {"level_cuts": [round(float(c), 5) for c in self.level_cuts], "window": self.window,
                "prior": self.prior, "reference": [round(float(v), 5) for v in self.reference]}

    @classmethod
    def from_json(cls, d: dict) -> "RankCalibrator":
        return cls(d["level_cuts"], d["reference"], window=d.get("window", DEFAULT_WINDOW),
                   prior=d.get("prior", DEFAULT_PRIOR))


def reference_sample(values: np.ndarray, size: int = 201) -> np.ndarray:
    """Quantiles of the validation scores, a compact stand-in for their CDF."""
    return np.quantile(np.asarray(values, dtype=np.float64), np.linspace(0.0, 1.0, size))


def stream_classes(keys: list, models: list[str], values: np.ndarray, calib_json: dict,
                   order: list[int]) -> np.ndarray:
    """Evaluation: each group (`keys[i]`, e.g. prompt set x model) as its own traffic stream, rows in
    `order`, one fresh calibrator per group (it only sees the predictions before each row)."""
    streams: dict = {}
    out = np.zeros(len(values), dtype=np.int64)
    for i in order:
        cal = streams.get(keys[i])
        if cal is None:
            cal = streams[keys[i]] = RankCalibrator.from_json(calib_json)
        out[i] = cal.classify(models[i], float(values[i]))
    return out
