"""The output-length hint every service agrees on, for the gateway's local answer when the
predictor is slow or gone (issue 13: the prediction is a hint, never a reason to fail).

The same rule as the predictor's (`services/predictor/policy.py`, Aladdin §2.3): the mean
output length of past requests whose input length falls in the same power-of-two bucket,
else the model-wide mean, else the prior of 129 tokens (the median output length of the
Azure LLM 2023 conversation trace); never above the request's `max_tokens`. Model names are
normalised as the predictor does (`model_names.canonical`). Length classes are those the
predictor gives a model its artifact does not know: the shipped artifact's unseen-model
bounds (`length_classes.UNSEEN_BOUNDS`, 101/205/290/661 tokens), so a local class means what
the predictor's does for such a model (the gateway has no artifact, so a model the artifact
knows is classed by these bounds too, not its own percentiles). `LocalLengths` keeps that
history in memory, from the `completed` requests one process saw. Pure: no I/O."""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from polyserve.core.length_classes import UNSEEN_BOUNDS
from polyserve.core.model_names import canonical

PRIOR_TOKENS = 129
"""Median output tokens of the Azure LLM 2023 conversation trace (as the predictor's prior)."""
CLASS_BOUNDS: tuple[int, ...] = UNSEEN_BOUNDS
MIN_SAMPLES = 5


def bucket_of(input_tokens: int) -> int:
    """Power-of-two bucket of an input length: floor(log2(n)), with 0 and 1 in bucket 0."""
    return max(0, int(input_tokens).bit_length() - 1)


def capped(tokens: int, max_tokens: int) -> int:
    """An estimate within the request's hard cap (0 = no cap known)."""
    return min(tokens, max_tokens) if max_tokens > 0 else tokens


def length_class(tokens: float, bounds: Sequence[float] = CLASS_BOUNDS) -> int:
    """Class 0..len(bounds): k such that bounds[k-1] <= tokens < bounds[k]."""
    return bisect_right(bounds, tokens)


class LocalLengths:
    """Per-model (count, sum) of output lengths by input bucket, in memory, bounded in size."""

    def __init__(self, min_samples: int = MIN_SAMPLES, max_models: int = 1024):
        self.min_samples = min_samples
        self.max_models = max_models
        self._stats: dict[str, dict[int, list[int]]] = {}

    def observe(self, model: str, input_tokens: int, output_tokens: int) -> None:
        if output_tokens <= 0:
            return
        model = canonical(model) or model
        if model not in self._stats and len(self._stats) >= self.max_models:
            self._stats.pop(next(iter(self._stats)))
        s = self._stats.setdefault(model, {}).setdefault(bucket_of(input_tokens), [0, 0])
        s[0] += 1
        s[1] += int(output_tokens)

    def estimate(self, model: str, input_tokens: int, max_tokens: int = 0) -> tuple[int, int, str]:
        """(tokens, length class, source): source "history" or "prior"."""
        buckets = self._stats.get(canonical(model) or model, {})
        one = buckets.get(bucket_of(input_tokens), [0, 0])
        overall = [sum(c for c, _ in buckets.values()), sum(t for _, t in buckets.values())]
        for count, total in (one, overall):
            if count >= self.min_samples:
                tokens = capped(max(1, round(total / count)), max_tokens)
                return tokens, length_class(tokens), "history"
        tokens = capped(PRIOR_TOKENS, max_tokens)
        return tokens, length_class(tokens), "prior"
