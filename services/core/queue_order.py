"""Queue orders a worker (and the simulator) applies to its waiting requests, and the
head-of-line admission check (no I/O): the sim and hf engines, the simulator and the
tests call this very code. The performance models live in `polyserve.core.perf`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


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


# Speculative shortest-job-first with aging (µ-Serve §3.3, §3.5).
#
# Aging rule: a waiting request's sort key is its *virtual arrival*
#     arrival + length_class × aging_s
# (ties: real arrival). Predicted-short requests go first, but a request of class k can
# only be overtaken by requests that arrive less than k·aging_s after it: once it has
# waited k·aging_s, every later arrival sorts behind it, so nothing starves. It is the
# linear aging "priority = class − waited / aging_s" with the common `now` term dropped,
# so the key never changes while a request waits (heaps and sorted queues stay valid)
# and the order needs no clock. A request without a prediction (length_class < 0) is
# taken as class UNKNOWN_CLASS (the middle of µ-Serve's five).
AGING_S = 5.0
UNKNOWN_CLASS = 2


def length_class_of(r: object) -> int:
    """A queued request's predicted length class (engines keep it on `r` or on `r.req`)."""
    cls = getattr(r, "length_class", None)
    if cls is None:
        cls = getattr(getattr(r, "req", None), "length_class", -1)
    return UNKNOWN_CLASS if cls is None or cls < 0 else int(cls)


def fcfs_key(r: Queued) -> float:
    """Sort key of `fcfs`."""
    return r.arrival


def priority_key(r: Queued) -> tuple[int, float]:
    """Sort key of `priority_fcfs`."""
    return (r.priority, r.arrival)


def ssjf_key(r: Queued, aging_s: float = AGING_S) -> tuple[float, float]:
    """Sort key of speculative SJF with aging: (virtual arrival, arrival); see the aging rule."""
    return (r.arrival + length_class_of(r) * aging_s, r.arrival)


def speculative_sjf(waiting: Sequence[Q]) -> list[Q]:
    """µ-Serve speculative SJF: shortest predicted length class first, with aging (`ssjf_key`)."""
    return sorted(waiting, key=ssjf_key)


def make_ssjf(aging_s: float) -> OrderFn:
    """Speculative SJF with another aging period (seconds per length class)."""
    if aging_s <= 0:
        raise ValueError("aging_s must be > 0 (seconds a request waits to gain one length class)")
    return lambda waiting: sorted(waiting, key=lambda r: ssjf_key(r, aging_s))


def oracle_key(r: Queued) -> tuple[int, float]:
    """Sort key of `oracle_sjf`: the true output length (`r.true_tokens`), then arrival."""
    return (r.true_tokens, r.arrival)  # type: ignore[attr-defined]


def oracle_sjf(waiting: Sequence[Q]) -> list[Q]:
    """Shortest-job-first on the true output length, no aging: the bound speculative SJF is
    measured against (µ-Serve §4.3). Simulator only: a live engine does not know the length."""
    return sorted(waiting, key=oracle_key)


ORDERS: dict[str, OrderFn] = {"fcfs": fcfs, "priority": priority_fcfs, "ssjf": speculative_sjf}
"""Queue orders a live engine may use (the worker setting `scheduling` names one)."""

ORDER_KEYS: dict[str, Callable[[Queued], object]] = {"fcfs": fcfs_key, "priority": priority_key,
                                                     "ssjf": ssjf_key, "sjf_oracle": oracle_key}
"""Each order as a static sort key (`sorted(waiting, key=ORDER_KEYS[name])` == `ORDERS[name]`);
includes the simulator-only `sjf_oracle`. Static keys let a simulator keep a heap."""


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
