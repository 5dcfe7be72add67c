"""ssjf's size rule and its refinement: the state one worker's queue keeps for speculative SJF
(`SizeRule`: ranks of recent sizes, the overtake window W, the tail guard) and what refines a
request's size as its tokens come (`RemainingEstimator`, `Preemptor`). No I/O. `queue_order`
builds the queue orders on these and re-exports every name here, so callers import it alone
(these live apart only to keep each module a readable size).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol, TypeVar

from polyserve.core.length_classes import UNSEEN_MEDIANS


class Queued(Protocol):
    """What an order function may look at."""

    arrival: float
    priority: int


Q = TypeVar("Q", bound=Queued)


# `ssjf` (speculative shortest-job-first, the default: size rank with a bounded overtake window;
# docs/experiments/sjf.md measures it). A waiting request sorts by its *virtual arrival*
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
# Tail guard (TAIL_GUARD; on in a live worker's `ssjf` and `ssjf_refine`): a request that has
# waited longer than the P70 of the worker's recent JCTs goes ahead of every request that has
# not, first come first served among such (`SizeRule.guard`, `queue_order.overdue`). W bounds
# who may overtake a request, not how much work they bring: behind a deep queue of short jobs a
# long one still waited well past FCFS's tail (docs/experiments/sjf.md). The guard is a quantile
# of the JCTs the worker gives anyway, so it is as scale-free as W. The order promotes overdue
# requests (`queue_order.guarded`; the simulator, from a heap by arrival); `SizeRule.key` stays fixed.
#
# A request without a prediction (length_class < 0, predicted_tokens <= 0) is taken as
# class UNKNOWN_CLASS, with the unseen-model class median as its tokens.
UNKNOWN_CLASS = 2
INPUT_WEIGHT = 0.125
WINDOW_FACTOR = 2.0
WINDOW_S = 120.0
HISTORY = 1000
JCT_EWMA = 0.02  # weight of one completion in the moving mean JCT (~50 completions of memory)
# P70 since 2026-11-28 (was P80): the lowest quantile tried that keeps ssjf's P99 within 1.10 x FCFS's on
# every trace and load of docs/experiments/sjf.md at max batch 64 (P80: 1.14 on Azure code at load 0.8)
TAIL_GUARD = 0.7  # ssjf, ssjf_refine: a request waiting past the P70 of recent JCTs goes first (FCFS among such)
GUARD_HISTORY = 500  # recent completions whose JCT quantile is the tail guard
GUARD_MIN = 50  # completions before the tail guard acts
GUARD_REFRESH = 25  # completions between recomputations of that quantile


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


def client_of(r: object) -> object:
    """The client (tenant) that sent a queued request where the engine keeps one (`client` or
    `tenant` on `r` or `r.req`), else None."""
    for obj in (r, getattr(r, "req", None)):
        for name in ("client", "tenant"):
            v = getattr(obj, name, None)
            if v is not None and v != -1 and v != "":
                return v
    return None


def _request_id(r: object) -> object:
    rid = getattr(r, "request_id", None)
    if rid is None:
        rid = getattr(getattr(r, "req", None), "request_id", None)
    return rid if rid is not None else id(r)


class SizeRule:
    """`ssjf`'s state and key (see the rule above). One per worker queue."""

    def __init__(self, input_weight: float = INPUT_WEIGHT, window_factor: float = WINDOW_FACTOR,
                 window_s: float = WINDOW_S, history: int = HISTORY, estimator: RemainingEstimator | None = None,
                 tail_guard: float = 0.0):
        if input_weight < 0 or window_factor <= 0 or window_s <= 0 or history < 1:
            raise ValueError("ssjf: input_weight >= 0, window_factor > 0, window_s > 0 and history >= 1 needed")
        self.input_weight, self.window_factor, self.window_s = input_weight, window_factor, window_s
        self.history = history
        self.estimator = estimator  # set: a waiting request's output estimate is E[L | predicted class]
        if not 0.0 <= tail_guard < 1.0:
            raise ValueError("ssjf: tail_guard is a quantile in [0, 1) (0 = off)")
        self.tail_guard = tail_guard
        self._jcts: deque[float] = deque(maxlen=GUARD_HISTORY)
        self._guard: float | None = None
        self._guard_new = 0
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._jct: float | None = None
        self._memo: OrderedDict[object, tuple[float, float]] = OrderedDict()
        self._cold: dict[object, float] = {}  # rank of requests keyed before any completion (see key)

    def size(self, r: object) -> float:
        """Expected job size in output-token equivalents."""
        out = predicted_tokens_of(r) if self.estimator is None else \
            self.estimator.remaining(length_class_of(r), predicted_tokens_of(r), 0, client_of(r))
        return out + self.input_weight * input_tokens_of(r)

    @property
    def window(self) -> float:
        """W: how long after a request others may still arrive and overtake it (seconds)."""
        return self.window_s if self._jct is None else self.window_factor * self._jct

    def observe(self, jct_s: float) -> None:
        """A request completed `jct_s` seconds after it arrived (moves W)."""
        self._jct = jct_s if self._jct is None else (1 - JCT_EWMA) * self._jct + JCT_EWMA * jct_s
        if self.tail_guard:
            self._jcts.append(jct_s)
            self._guard_new += 1

    def guard(self) -> float | None:
        """Tail guard (seconds): a request that has waited longer than the `tail_guard` quantile of
        recent completions' JCT goes ahead of every request that has not, first come first served
        among such (the engine promotes it). None while off or before GUARD_MIN completions."""
        if not self.tail_guard or len(self._jcts) < GUARD_MIN:
            return None
        if self._guard is None or self._guard_new >= GUARD_REFRESH:
            srt = sorted(self._jcts)
            self._guard, self._guard_new = srt[min(len(srt) - 1, int(self.tail_guard * len(srt)))], 0
        return self._guard

    def key_for(self, arrival: float, size: float) -> tuple[float, float]:
        """The key of a request of `size` that arrived at `arrival`, by the current ranks and W
        (no memo, no history): for a running request's refined remaining size."""
        rank = bisect_left(self._sorted, size) / len(self._sorted) if self._sorted else 0.5
        return (arrival + self.window * rank, arrival)

    def rekey(self, r: Queued, key: tuple[float, float]) -> None:
        """`r` sorts by `key` from now on (a paused request's refined key)."""
        self._memo[(_request_id(r), r.arrival)] = key

    @property
    def warm(self) -> bool:
        """Whether W follows completions yet (False: it is still the cold `window_s`)."""
        return self._jct is not None

    def key(self, r: Queued) -> tuple[float, float]:
        """Memoised once W follows completions. Keyed before the first completion, a request keeps
        its rank, not the cold W (120 s): its key is fixed with the first warm W. Fixed at the
        cold W, the long requests of a fresh worker's first burst sorted up to 120 s late.
        The simulator re-keys its waiting heap when the rule warms (`cluster._step_done`)."""
        rid = (_request_id(r), r.arrival)
        got = self._memo.get(rid)
        if got is not None:
            return got
        rank = self._cold.pop(rid, None) if self._jct is not None else self._cold.get(rid)
        if rank is None:
            s = self.size(r)
            rank = bisect_left(self._sorted, s) / len(self._sorted) if self._sorted else 0.5
            self._recent.append(s)
            insort(self._sorted, s)
            if len(self._recent) > self.history:
                self._sorted.pop(bisect_left(self._sorted, self._recent.popleft()))
            if self._jct is None and len(self._cold) < 8 * self.history:
                self._cold[rid] = rank
        got = (r.arrival + self.window * rank, r.arrival)
        if self._jct is None:
            return got
        self._memo[rid] = got
        if len(self._memo) > 8 * self.history:
            self._memo.popitem(last=False)
        return got


# ------------------------------------------------------------------ refinement (TRAIL-style)
# A prediction made before the first token is weak (the shipped predictor's out-of-distribution
# accuracy is ~0.37); how long a request has already run is not. `RemainingEstimator` gives
#     remaining(class, g) = E[L − g | L > g, predicted class]
# from a survival table of completed requests' true lengths per predicted class (the
# worker learns it from its own completions; classes pooled until one has MIN_SAMPLES,
# the prediction itself until the pool has them). `Preemptor` uses it at iteration
# boundaries: when the batch is full, a running request whose key *now* (SizeRule.key_for
# its remaining size) sorts behind a waiting request's key is paused, its KV kept where
# memory allows, and the waiting one takes its slot (shortest expected remaining first).
# Starvation bound: the same as ssjf's: every key is at most arrival + W, so a request
# can only be paused for requests that arrived less than W after it.
REFINE_HISTORY = 2000  # completed requests remembered per class
REFINE_MIN_SAMPLES = 30  # completions before any table is used (the prediction until then)
REFINE_PRIOR = 20.0  # weight, in samples, of a table's parent when a table is shrunk towards it
REFINE_REBUILD = 32  # a class's table is re-sorted after this many new completions
PREEMPT_QUANTUM = 16  # decode steps a request runs after (re)admission before it may be paused
PREEMPT_MARGIN = 0.05  # ssjf: a waiting key must beat a running one by this share of W to pause it


class RemainingEstimator:
    """Expected remaining output tokens given the predicted class and tokens generated so far;
    with `by_client`, also given the client (tenant) that sent it, where the engine knows one
    (`client_of`): a client's requests tend to look alike (ServeGen: per-client means from 91 to
    16,000 tokens on one reasoning model). Tables, most specific first: (client, class),
    client, class, all (`remaining` shrinks each towards the next)."""

    def __init__(self, history: int = REFINE_HISTORY, min_samples: int = REFINE_MIN_SAMPLES, by_client: bool = False):
        if history < 1 or min_samples < 1:
            raise ValueError("RemainingEstimator: history >= 1 and min_samples >= 1 needed")
        self.history, self.min_samples, self.by_client = history, min_samples, by_client
        self._lens: dict[object, deque[int]] = {}
        self._new: dict[object, int] = {}
        self._tables: dict[object, tuple[list[int], list[float]]] = {}

    def _keys(self, cls: int, client: object) -> list[object]:
        keys: list[object] = [("class", cls), None]
        if self.by_client and client is not None:
            keys[:0] = [("client", client, cls), ("client", client)]
        return keys

    def observe(self, cls: int, length: int, client: object = None) -> None:
        """A request predicted as `cls` (-1: none) completed with `length` output tokens."""
        for key in self._keys(cls, client):
            d = self._lens.setdefault(key, deque(maxlen=self.history))
            d.append(int(length))
            self._new[key] = self._new.get(key, 0) + 1

    def samples(self, key: object) -> int:
        return len(self._lens.get(key, ()))

    def _table(self, key) -> tuple[list[int], list[float]]:
        if self._new.get(key, 0) >= REFINE_REBUILD or key not in self._tables:
            srt = sorted(self._lens[key])
            suffix = [0.0] * (len(srt) + 1)
            for i in range(len(srt) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + srt[i]
            self._tables[key], self._new[key] = (srt, suffix), 0
        return self._tables[key]

    def remaining(self, cls: int, predicted: float, generated: int, client: object = None) -> float:
        """E[L − generated | L > generated] by the tables, shrunk from the pool towards the most
        specific one (each table's estimate weighted by its n samples above `generated` against
        REFINE_PRIOR for its parent's: a client seen 5 times moves the estimate a little, one seen
        500 times decides it). `predicted − generated` (at least 1) before the pool has MIN_SAMPLES
        completions, or when the request has outlived every one it knows of (then it is taken to
        be about to finish: the longest requests are not paused)."""
        keys = self._keys(cls, client)
        if self.samples(None) < self.min_samples:
            return max(1.0, predicted - generated)
        est = None
        for key in reversed(keys):  # the pool first, then ever more specific
            if not self.samples(key):
                continue
            srt, suffix = self._table(key)
            k = bisect_left(srt, generated + 1)  # samples with L > generated
            n = len(srt) - k
            if n == 0:
                continue
            mine = suffix[k] / n - generated
            est = mine if est is None else (n * mine + REFINE_PRIOR * est) / (n + REFINE_PRIOR)
        return max(1.0, predicted - generated) if est is None else max(1.0, est)


class Preemptor:
    """Shortest-expected-remaining-first at iteration boundaries (see the block above).

    `victims(running, waiting_keys)` takes the running requests as (key now, tokens run
    since (re)admission, request) and the smallest waiting keys in order; it returns the
    running requests to pause, worst first: the k-th worst running one is paused when the
    k-th best waiting key sorts before its key. A request that has run fewer than `quantum`
    decode steps since it was (re)admitted is not paused (no thrashing)."""

    def __init__(self, quantum: int = PREEMPT_QUANTUM):
        if quantum < 1:
            raise ValueError("Preemptor: quantum >= 1 decode step needed")
        self.quantum = quantum

    def victims(self, running: Sequence[tuple[object, int, Q]], waiting_keys: Sequence[object],
                margin: float = 0.0) -> list[Q]:
        """`margin`: a waiting key must sort before a running one by this much in its first
        field (ssjf: PREEMPT_MARGIN × W; the oracle: 0) — hysteresis, so two requests whose
        keys cross as they generate do not swap places every quantum."""
        cand = sorted(((k, r) for k, ran, r in running if k is not None and ran >= self.quantum),
                      key=lambda x: x[0], reverse=True)  # type: ignore[arg-type, return-value]
        out: list[Q] = []
        for (rk, r), wk in zip(cand, waiting_keys):
            if not wk < rk or (margin and not wk[0] + margin < rk[0]):  # type: ignore[index, operator]
                break
            out.append(r)
        return out


def refined_ssjf_key(rule: SizeRule, est: RemainingEstimator, r: object, generated: int,
                     prefill_tokens: int = 0) -> tuple[float, float]:
    """`rule`'s key of request `r` now: its expected remaining output after `generated` tokens,
    plus the prompt term for the `prefill_tokens` it would have to prefill (again) to go on."""
    rem = est.remaining(length_class_of(r), predicted_tokens_of(r), generated, client_of(r))
    return rule.key_for(r.arrival, rem + rule.input_weight * prefill_tokens)  # type: ignore[attr-defined]
