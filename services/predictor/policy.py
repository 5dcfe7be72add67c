"""Output-length estimation as pure functions (no I/O): Aladdin's historical
conditional mean (§2.3), input-length buckets and length classes.

Aladdin §2.3 predicts a request's output length as the mean output length of
past requests with the same input length: "we use the estimated output length
of each input length in the historical data as the predicted output length".
The mean is unbiased, so errors of requests batched together partly cancel;
Aladdin corrects the rest by re-balancing (§4.3).

Input lengths are grouped into power-of-two **buckets** so that every bucket
collects enough samples: bucket ``b`` holds inputs of ``2**b <= n < 2**(b+1)``
tokens, and inputs of 0 or 1 token fall in bucket 0 (so 2-3 tokens -> 1,
4-7 -> 2, ..., 1024-2047 -> 10). Buckets are exponential because output-length
distributions change with the order of magnitude of the prompt, not with each
token (Aladdin Fig. 2 plots them by prompt-length range).

Statistics per (model, bucket) are a count, a sum and a sum of squares of output
tokens; they live in the Redis hash ``Keys.lenstats(model)`` with the fields
``n:<bucket>``, ``sum:<bucket>`` and ``sumsq:<bucket>`` (see `hash_increments`),
incremented atomically (HINCRBY / HINCRBYFLOAT) so several predictors can share
them. The model-wide figures are the sums over buckets.

Estimate (`estimate`): the bucket mean when the bucket has at least
``min_samples`` samples (source ``"history"``); else the model-wide mean when the
model has that many (``"history"``); else the prior (``"prior"``); never above the
request's ``max_tokens`` when it is known (`capped`). The default prior, 129
tokens, is the median output length of the Azure LLM inference trace 2023,
conversation workload (Azure/AzurePublicDataset,
``AzureLLMInferenceTrace_conv.csv``, 19,366 requests; in
``../shared/datasets/traces/azure_llm_2023_conv.csv``).

Length classes (`length_class`): ``num_classes = len(bounds) + 1`` ordered
classes; class ``k`` holds estimates with ``bounds[k-1] <= tokens < bounds[k]``.
The service passes the proxy artifact's per-model percentile bounds (µ-Serve §3.3:
p25/p50/p75/p99 of the model's training answers) for a model the artifact knows and
its unseen-model bounds otherwise (`handlers.PredictHandlers.class_bounds`), so a
class means the same whichever source answered. The default bounds, used without an
artifact, are the shipped artifact's unseen-model bounds ``(101, 205, 290, 661)``
(`polyserve.core.length_classes.UNSEEN_BOUNDS`; before issue 17: 32/128/256/512).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from polyserve.core.length_classes import UNSEEN_BOUNDS
from polyserve.core.length_hint import MIN_SAMPLES, PRIOR_TOKENS, bucket_of, capped, length_class  # noqa: F401

# The prior, the buckets, the cap and the class lookup are shared with the gateway's local
# fallback, so they live once in `polyserve.core.length_hint` (re-exported here).
DEFAULT_CLASS_BOUNDS: tuple[int, ...] = UNSEEN_BOUNDS
DEFAULT_MIN_SAMPLES = MIN_SAMPLES

SOURCE_HISTORY = "history"
SOURCE_PRIOR = "prior"


def bucket_range(bucket: int) -> tuple[int, int]:
    """Input lengths ``[low, high)`` of a bucket (bucket 0 also holds 0 tokens)."""
    return (0 if bucket == 0 else 2 ** bucket), 2 ** (bucket + 1)


@dataclass(frozen=True, slots=True)
class LenStats:
    """Count, sum and sum of squares of output lengths."""

    count: int = 0
    total: float = 0.0
    sumsq: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation (0 with fewer than two samples)."""
        if self.count < 2:
            return 0.0
        var = self.sumsq / self.count - self.mean ** 2
        return math.sqrt(max(0.0, var))

    def __add__(self, other: "LenStats") -> "LenStats":
        return LenStats(self.count + other.count, self.total + other.total, self.sumsq + other.sumsq)


@dataclass(frozen=True, slots=True)
class ModelStats:
    """The length statistics of one model: per-bucket LenStats."""

    buckets: Mapping[int, LenStats] = field(default_factory=dict)

    @property
    def overall(self) -> LenStats:
        """Model-wide statistics (sum over buckets)."""
        acc = LenStats()
        for s in self.buckets.values():
            acc = acc + s
        return acc

    def bucket(self, b: int) -> LenStats:
        return self.buckets.get(b, LenStats())

    def merged(self, other: "ModelStats") -> "ModelStats":
        """Bucket-wise sum of two statistics."""
        out = dict(self.buckets)
        for b, s in other.buckets.items():
            out[b] = out.get(b, LenStats()) + s
        return ModelStats(out)


def observe(stats: ModelStats, input_tokens: int, output_tokens: int) -> ModelStats:
    """Statistics after one more (input, output) observation."""
    return stats.merged(ModelStats({bucket_of(input_tokens): LenStats(1, output_tokens, output_tokens ** 2)}))


def hash_increments(input_tokens: int, output_tokens: int) -> list[tuple[str, int | float]]:
    """The (field, increment) pairs one completed request adds to the lenstats hash.

    ``n:`` and ``sum:`` fields are integers (HINCRBY); ``sumsq:`` is a float
    (HINCRBYFLOAT) since it can outgrow 64-bit integers over a long history.
    """
    b = bucket_of(input_tokens)
    out = int(output_tokens)
    return [(f"n:{b}", 1), (f"sum:{b}", out), (f"sumsq:{b}", float(out * out))]


def stats_increments(stats: ModelStats) -> list[tuple[str, int | float]]:
    """The hash increments that add `stats` (e.g. a buffer of unsaved observations)."""
    fields: list[tuple[str, int | float]] = []
    for b, s in sorted(stats.buckets.items()):
        fields += [(f"n:{b}", int(s.count)), (f"sum:{b}", int(s.total)), (f"sumsq:{b}", float(s.sumsq))]
    return fields


def parse_hash(mapping: Mapping[bytes | str, bytes | str]) -> ModelStats:
    """ModelStats from the fields of a lenstats hash (HGETALL); unknown fields are ignored."""
    counts: dict[int, int] = {}
    sums: dict[int, float] = {}
    sumsqs: dict[int, float] = {}
    for raw_key, raw_val in mapping.items():
        key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
        kind, _, b = key.partition(":")
        try:
            bucket = int(b)
            value = float(raw_val)
        except ValueError:
            continue
        if kind == "n":
            counts[bucket] = int(value)
        elif kind == "sum":
            sums[bucket] = value
        elif kind == "sumsq":
            sumsqs[bucket] = value
    return ModelStats({b: LenStats(n, sums.get(b, 0.0), sumsqs.get(b, 0.0)) for b, n in counts.items() if n > 0})


def parse_bounds(text: str | Iterable[int]) -> tuple[int, ...]:
    """Class bounds from "32,128,256,512" (or ints); raise ValueError unless strictly increasing and > 0."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    try:
        bounds = tuple(int(p) for p in parts if p != "")
    except ValueError as exc:
        raise ValueError(f"class bounds {text!r} must be comma-separated integers, e.g. '32,128,256,512'") from exc
    if not bounds:
        raise ValueError("class bounds must name at least one bound, e.g. '32,128,256,512'")
    if bounds[0] <= 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"class bounds {bounds} must be positive and strictly increasing")
    return bounds


@dataclass(frozen=True, slots=True)
class Estimate:
    """One answer of the predictor."""

    tokens: int
    length_class: int
    num_classes: int
    source: str  # "history" | "prior"
    bucket: int
    samples: int  # how many observations the estimate rests on (0 for the prior)


def estimate(stats: ModelStats | None, input_tokens: int, *, min_samples: int = DEFAULT_MIN_SAMPLES,
             prior_tokens: int = PRIOR_TOKENS, bounds: Sequence[float] = DEFAULT_CLASS_BOUNDS,
             max_tokens: int = 0) -> Estimate:
    """Aladdin's conditional mean for `input_tokens`: bucket mean, else model mean, else the
    prior; capped at `max_tokens` when > 0 (the length class is that of the capped estimate)."""
    b = bucket_of(input_tokens)
    stats = stats or ModelStats()
    for s in (stats.bucket(b), stats.overall):
        if s.count >= min_samples:
            tokens = capped(max(1, round(s.mean)), max_tokens)
            return Estimate(tokens, length_class(tokens, bounds), len(bounds) + 1, SOURCE_HISTORY, b, s.count)
    tokens = capped(max(1, int(prior_tokens)), max_tokens)
    return Estimate(tokens, length_class(tokens, bounds), len(bounds) + 1, SOURCE_PRIOR, b, 0)
