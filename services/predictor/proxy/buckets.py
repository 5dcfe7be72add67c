"""Length buckets of micro-batches (no torch here: the service imports it on its event loop)."""
from __future__ import annotations

import math


def bucket_length(n: int, step: int = 64, cap: int = 512) -> int:
    """Pad length of a batch whose longest prompt has `n` tokens: the next multiple of `step`, at most `cap`.

    Arlo's staircase of static lengths: padding only to the bucket (64, 128,
    192, ...) instead of the model maximum saves the attention and FFN work on
    padding, while batches keep a handful of shapes."""
    return min(cap, max(step, int(math.ceil(n / step)) * step))
