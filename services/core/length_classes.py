"""What a `length_class` means, shared by the predictor and the gateway's local hint (pure).

A length class is a **per-model percentile class** (µ-Serve §3.3): for a target model the
artifact knows, its bounds are the p25/p50/p75/p99 of that model's training answers, so
class 2 means "between this model's median and p75", whatever the model's verbosity.

For a model the artifact does not know (and wherever no artifact is at hand: the
predictor without a model, the gateway's local fallback) the **unseen-model scheme**
applies: per class, the geometric mean over the artifact's training models of their
bounds and of their class medians, every training model weighted equally
(`unseen_scheme`). The artifact's unknown-model row is trained on labels in each dropped
model's *own* classes, so its output is a class of "some model"; decoding it with the
scheme of a typical model (a geometric mean, since lengths spread on a log scale) keeps
the token estimate on the scale of a typical model rather than the scale of the pooled
answers (dominated by the largest training source). `UNSEEN_BOUNDS` / `UNSEEN_MEDIANS`
are this scheme for the shipped artifact (`services/predictor/artifacts/proxy-minilm`),
bounds rounded up to whole tokens (same classes for integer lengths); a unit test keeps
them equal to what the shipped meta.json gives.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

UNSEEN_BOUNDS: tuple[int, ...] = (101, 205, 290, 661)
"""Class bounds (tokens) of an unseen model, from the shipped artifact (see module docstring)."""
UNSEEN_MEDIANS: tuple[int, ...] = (51, 155, 245, 355, 848)
"""Token estimate of each class of an unseen model, from the shipped artifact."""
NUM_CLASSES = len(UNSEEN_BOUNDS) + 1


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


def unseen_scheme(schemes: Sequence[tuple[Sequence[float], Sequence[float]]]
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(bounds, medians) for an unseen model from the (bounds, medians) of each known model:
    the per-class geometric mean over models; bounds kept strictly increasing (+1 token on a tie).
    ValueError when `schemes` is empty or the models have different numbers of classes."""
    if not schemes:
        raise ValueError("no known model to derive the unseen-model classes from")
    nb = {len(b) for b, _ in schemes}
    nm = {len(m) for _, m in schemes}
    if len(nb) != 1 or nm != {nb.pop() + 1}:
        raise ValueError("known models have different numbers of length classes")
    bounds: list[float] = []
    for k in range(len(schemes[0][0])):
        b = _geomean([s[0][k] for s in schemes])
        bounds.append(b if not bounds or b > bounds[-1] else bounds[-1] + 1.0)
    medians = tuple(_geomean([s[1][k] for s in schemes]) for k in range(len(schemes[0][1])))
    return tuple(bounds), medians
