"""Pure scheduling and cost models of the worker (no I/O): the sim engine, the tests
and any offline simulator call this very code.

Performance models are Aladdin §3 (`../shared/papers/aladdin-joint-placement-scaling.txt`):

* KV cache (Eq. 1):      kv  = h·(l_in + l_out) + j            per sequence
* prefill (Eq. 2):       t_p = k1·Σl_in + c1                    ms, one prefill batch
* decode step (Eq. 3):   t_d = (k2·l_avg + c2)·b + c3           ms, b sequences of mean context l_avg
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class PerfModel:
    """Coefficients of Aladdin's models; times in ms, KV in tokens when h=1, j=0."""

    k1: float
    c1: float
    k2: float
    c2: float
    c3: float
    h: float = 1.0
    j: float = 0.0


def prefill_ms(model: PerfModel, total_input_tokens: int) -> float:
    """Time of one prefill batch whose prompts hold `total_input_tokens` tokens (Eq. 2)."""
    if total_input_tokens <= 0:
        return 0.0
    return max(0.0, model.k1 * total_input_tokens + model.c1)


def decode_ms(model: PerfModel, l_avg: float, batch: int) -> float:
    """Time of one decode step of `batch` sequences of mean context length `l_avg` (Eq. 3)."""
    if batch <= 0:
        return 0.0
    return max(0.0, (model.k2 * l_avg + model.c2) * batch + model.c3)


def kv_demand(model: PerfModel, l_in: int, l_out: int, n: int = 1) -> int:
    """Peak KV demand of a request with `n` independent sequences (Eq. 1), rounded up."""
    return n * math.ceil(model.h * (l_in + l_out) + model.j)


# ------------------------------------------------------------------ queue order
class Queued(Protocol):
    """What an order function may look at."""

    arrival: float
    priority: int


Q = TypeVar("Q", bound=Queued)
OrderFn = Callable[[Sequence[Q]], list[Q]]


def fcfs(waiting: Sequence[Q]) -> list[Q]:
    """First come, first served (stable on equal arrival)."""
    return sorted(waiting, key=lambda r: r.arrival)


def priority_fcfs(waiting: Sequence[Q]) -> list[Q]:
    """Lower `priority` value first (vLLM convention), FCFS within a priority."""
    return sorted(waiting, key=lambda r: (r.priority, r.arrival))


ORDERS: dict[str, OrderFn] = {"fcfs": fcfs, "priority": priority_fcfs}


# ------------------------------------------------------------------ admission
class Candidate(Protocol):
    """What admission looks at: batch slots (one per sequence) and KV demand."""

    seqs: int
    kv_demand: int


def admit_count(ordered: Sequence[Candidate], running_seqs: int, kv_used: int,
                max_batch: int, kv_capacity: int) -> int:
    """How many of the `ordered` waiting requests join the batch now.

    Head-of-line: admission stops at the first request that does not fit in the
    batch slots or the KV budget, so the order function is honoured exactly.
    """
    count = 0
    for cand in ordered:
        if running_seqs + cand.seqs > max_batch or kv_used + cand.kv_demand > kv_capacity:
            break
        running_seqs += cand.seqs
        kv_used += cand.kv_demand
        count += 1
    return count


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in `text` at or after `start`, or -1."""
    best = -1
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos >= 0 and (best < 0 or pos < best):
            best = pos
    return best
