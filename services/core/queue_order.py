"""Queue orders a worker (and the simulator) applies to its waiting requests, and the
head-of-line admission check (no I/O): the sim and hf engines, the simulator and the
tests call this very code. The performance models live in `polyserve.core.perf`.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from polyserve.core.length_classes import UNSEEN_MEDIANS


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


# Speculative shortest-job-first, two rules (docs/experiments/sjf.md measures both).
#
# `ssjf` (the default: size rank with a bounded overtake window). A waiting request sorts
# by its *virtual arrival*
#     arrival + W × rank(size)            (ties: real arrival)
#     size = expected output tokens + INPUT_WEIGHT × prompt tokens
#     rank = share of the last HISTORY arrivals whose size was smaller (0 … 1)
#     W    = WINDOW_FACTOR × (moving mean of recent completed requests' JCT), WINDOW_S before any
# The expected output tokens are the predictor's estimate (`predicted_tokens`); the prompt
# term is the prefill's cost: a prefill of p tokens stalls every running sequence for
# about k1·p ms, which at a full batch is the worker time of ~p/8 decoded tokens
# (Llama-2-70B/H100 profile: k1 = 0.107 ms per token; a 64-sequence decode step takes
# 55 ms, 0.86 ms per sequence), so a long prompt counts as a long job.
# Starvation bound: a request's key is at most arrival + W, so only requests that arrive
# less than W after it can overtake it; every later arrival sorts behind it. Its extra wait
# over FCFS is at most the work that arrives in that window, and W is a small multiple of
# the JCT the worker is giving anyway, so the tail stays close to FCFS's. Rank and W make
# the rule scale-free: the same setting serves 20-token code completions and 1,000-token
# reasoning answers. The key is computed once per request (memoised by request id) and
# never changes while it waits, so heaps and sorted queues stay valid; the only state is
# the recent sizes and JCTs (`SizeRule.observe` is fed by whoever sees completions; with
# no feed, W stays WINDOW_S).
#
# `ssjf_class` (the earlier rule, µ-Serve §3.3/§3.5 aging): virtual arrival
#     arrival + length_class × aging_s,
# the class alone, no prompt term, no bound beyond the top class's offset.
# A request without a prediction (length_class < 0, predicted_tokens <= 0) is taken as
# class UNKNOWN_CLASS, with the unseen-model class median as its tokens.
AGING_S = 5.0
UNKNOWN_CLASS = 2
INPUT_WEIGHT = 0.125
WINDOW_FACTOR = 2.0
WINDOW_S = 120.0
HISTORY = 1000
JCT_EWMA = 0.02  # weight of one completion in the moving mean JCT (~50 completions of memory)


def length_class_of(r: object) -> int:
    """A queued request's predicted length class (engines keep it on `r` or on `r.req`)."""
    cls = getattr(r, "length_class", None)
    if cls is None:
        cls = getattr(getattr(r, "req", None), "length_class", -1)
    return UNKNOWN_CLASS if cls is None or cls < 0 else int(cls)


def predicted_tokens_of(r: object) -> int:
    """A queued request's expected output tokens (on `r` or `r.req`); without an estimate,
    the unseen-model median of its class (`length_classes.UNSEEN_MEDIANS`)."""
    tok = getattr(r, "predicted_tokens", None)
    if tok is None:
        tok = getattr(getattr(r, "req", None), "predicted_tokens", 0)
    if tok and tok > 0:
        return int(tok)
    return UNSEEN_MEDIANS[min(length_class_of(r), len(UNSEEN_MEDIANS) - 1)]


def input_tokens_of(r: object) -> int:
    """A queued request's prompt tokens where the engine knows them (`input_len`, `input_tokens`), else 0."""
    for name in ("input_len", "input_tokens"):
        n = getattr(r, name, None)
        if n is None:
            n = getattr(getattr(r, "req", None), name, None)
        if isinstance(n, int):
            return n
    return 0


def _request_id(r: object) -> object:
    rid = getattr(r, "request_id", None)
    if rid is None:
        rid = getattr(getattr(r, "req", None), "request_id", None)
    return rid if rid is not None else id(r)


def fcfs_key(r: Queued) -> float:
    """Sort key of `fcfs`."""
    return r.arrival


def priority_key(r: Queued) -> tuple[int, float]:
    """Sort key of `priority_fcfs`."""
    return (r.priority, r.arrival)


class SizeRule:
    """`ssjf`'s state and key (see the rule above). One per worker queue."""

    def __init__(self, input_weight: float = INPUT_WEIGHT, window_factor: float = WINDOW_FACTOR,
                 window_s: float = WINDOW_S, history: int = HISTORY):
        if input_weight < 0 or window_factor <= 0 or window_s <= 0 or history < 1:
            raise ValueError("ssjf: input_weight >= 0, window_factor > 0, window_s > 0 and history >= 1 needed")
        self.input_weight, self.window_factor, self.window_s = input_weight, window_factor, window_s
        self.history = history
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._jct: float | None = None
        self._memo: OrderedDict[object, tuple[float, float]] = OrderedDict()

    def size(self, r: object) -> float:
        """Expected job size in output-token equivalents."""
        return predicted_tokens_of(r) + self.input_weight * input_tokens_of(r)

    @property
    def window(self) -> float:
        """W: how long after a request others may still arrive and overtake it (seconds)."""
        return self.window_s if self._jct is None else self.window_factor * self._jct

    def observe(self, jct_s: float) -> None:
        """A request completed `jct_s` seconds after it arrived (moves W)."""
        self._jct = jct_s if self._jct is None else (1 - JCT_EWMA) * self._jct + JCT_EWMA * jct_s

    def key_for(self, arrival: float, size: float) -> tuple[float, float]:
        """The key of a request of `size` that arrived at `arrival`, by the current ranks and W
        (no memo, no history): for a running request's refined remaining size."""
        rank = bisect_left(self._sorted, size) / len(self._sorted) if self._sorted else 0.5
        return (arrival + self.window * rank, arrival)

    def key(self, r: Queued) -> tuple[float, float]:
        rid = (_request_id(r), r.arrival)
        got = self._memo.get(rid)
        if got is not None:
            return got
        s = self.size(r)
        rank = bisect_left(self._sorted, s) / len(self._sorted) if self._sorted else 0.5
        self._recent.append(s)
        insort(self._sorted, s)
        if len(self._recent) > self.history:
            self._sorted.pop(bisect_left(self._sorted, self._recent.popleft()))
        got = (r.arrival + self.window * rank, r.arrival)
        self._memo[rid] = got
        if len(self._memo) > 8 * self.history:
            self._memo.popitem(last=False)
        return got


DEFAULT_RULE = SizeRule()
"""The rule behind ORDERS["ssjf"] / ORDER_KEYS["ssjf"] in a live worker (one queue per process)."""


def ssjf_key(r: Queued) -> tuple[float, float]:
    """Sort key of `speculative_sjf` (`DEFAULT_RULE`)."""
    return DEFAULT_RULE.key(r)


def speculative_sjf(waiting: Sequence[Q]) -> list[Q]:
    """Speculative SJF by expected size (output + prompt cost) with a starvation bound (`ssjf_key`)."""
    return sorted(waiting, key=ssjf_key)


def make_ssjf(**params) -> tuple[SizeRule, OrderFn]:
    """A fresh `SizeRule` with other parameters and its order function (ValueError on a bad one)."""
    rule = SizeRule(**params)
    return rule, lambda waiting: sorted(waiting, key=rule.key)


def ssjf_class_key(r: Queued, aging_s: float = AGING_S) -> tuple[float, float]:
    """Sort key of `speculative_sjf_class`: (arrival + class × aging_s, arrival)."""
    return (r.arrival + length_class_of(r) * aging_s, r.arrival)


def speculative_sjf_class(waiting: Sequence[Q]) -> list[Q]:
    """The earlier µ-Serve rule: shortest predicted class first, linear aging (`ssjf_class_key`)."""
    return sorted(waiting, key=ssjf_class_key)


def make_ssjf_class(aging_s: float) -> OrderFn:
    """`speculative_sjf_class` with another aging period (seconds per length class)."""
    if aging_s <= 0:
        raise ValueError("aging_s must be > 0 (seconds a request waits to gain one length class)")
    return lambda waiting: sorted(waiting, key=lambda r: ssjf_class_key(r, aging_s))


def oracle_key(r: Queued) -> tuple[int, float]:
    """Sort key of `oracle_sjf`: the true output length (`r.true_tokens`), then arrival."""
    return (r.true_tokens, r.arrival)  # type: ignore[attr-defined]


def oracle_sjf(waiting: Sequence[Q]) -> list[Q]:
    """Shortest-job-first on the true output length, no aging: the bound speculative SJF is
    measured against (µ-Serve §4.3). Simulator only: a live engine does not know the length."""
    return sorted(waiting, key=oracle_key)


ORDERS: dict[str, OrderFn] = {"fcfs": fcfs, "priority": priority_fcfs, "ssjf": speculative_sjf,
                              "ssjf_class": speculative_sjf_class}
"""Queue orders a live engine may use (the worker setting `scheduling` names one)."""

ORDER_KEYS: dict[str, Callable[[Queued], object]] = {"fcfs": fcfs_key, "priority": priority_key,
                                                     "ssjf": ssjf_key, "ssjf_class": ssjf_class_key,
                                                     "sjf_oracle": oracle_key}
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
