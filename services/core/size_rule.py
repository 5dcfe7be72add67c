"""ssjf's size rule and its refinement: the state one worker's queue keeps for speculative SJF
(`SizeRule`: ranks of recent sizes, the overtake window W, the tail guard) and what refines a
request's size as its tokens come (`RemainingEstimator`, `Preemptor`). No I/O. `queue_order`
builds the queue orders on these and re-exports every name here, so callers import it alone
(these live apart only to keep each module a readable size).
"""
from __future__ import annotations

import math
import time
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
# Overtake bound (OVERTAKE_BOUND, ε; on in a live worker's `ssjf` and `ssjf_refine` since
# 2026-11-28): a request may be overtaken by at most M = ⌈ε × the requests the worker completed in
# the last P99-JCT seconds⌉ others. When it arrives, the rule notes the completion count at which
# FCFS would have started it (completions so far + the requests waiting ahead of it by arrival);
# once the worker has completed more than M beyond that, it goes ahead of every request that has
# not, first come first served among such (`SizeRule.overtaken`, `queue_order.overdue`). Its wait
# then exceeds FCFS's by about M completions' worth of time, ε × the P99 JCT, so the P99 stays
# within about 1 + ε of FCFS's whatever the trace's scale (M is counted in the worker's own
# completions and JCTs). W bounds *who* may overtake a request (arrivals within W after it), not
# how much work they bring; the bound caps how many do. ε = 0.15: the largest tried (0.05–0.3)
# that kept ssjf's P99 within 1.10 x FCFS on every trace and load of docs/experiments/sjf.md and on
# two ServeGen traces not used before (multimodal mm-image; m-large on another day); checked then
# on three more windows left out of the choice (sjf.md, "the overtake bound").
#
# Tail guard (TAIL_GUARD, off by default since 2026-11-28; P70 before, P80 before that): a request
# that has waited longer than a quantile of the worker's recent JCTs goes first, FCFS among such
# (`SizeRule.guard`). A quantile of JCTs is not a bound on the extra wait: on traces the P70 was not
# chosen on, ssjf's P99 reached 1.12–1.18 x FCFS (docs/experiments/sjf.md). `--tail-guard Q` in the
# simulator and `SizeRule(tail_guard=Q)` still give it; either guard promotes. The order promotes
# overdue requests (`queue_order.guarded`; the simulator, from a heap by arrival); `SizeRule.key`
# stays fixed.
#
# A request without a prediction (length_class < 0, predicted_tokens <= 0) is taken as
# class UNKNOWN_CLASS, with the unseen-model class median as its tokens.
UNKNOWN_CLASS = 2
INPUT_WEIGHT = 0.125
WINDOW_FACTOR = 2.0
WINDOW_S = 120.0
HISTORY = 1000
JCT_EWMA = 0.02  # weight of one completion in the moving mean JCT (~50 completions of memory)
TAIL_GUARD = 0.0  # off (see the block above); P70 on 2026-11-28 until the overtake bound replaced it
OVERTAKE_BOUND = 0.15  # ssjf, ssjf_refine: ε of the overtake bound (see the block above)
TAIL_QUANTILE = 0.99  # the overtake bound counts the completions of the last P99-JCT seconds
GUARD_HISTORY = 500  # recent completions whose JCT quantiles the guards use
GUARD_MIN = 50  # completions before either guard acts
GUARD_REFRESH = 25  # completions between recomputations of those quantiles


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


def _queued_id(r: Queued) -> tuple[object, float]:
    """What the rule keys a queued request's memos by: its request id (else its object id) and arrival."""
    return (_request_id(r), r.arrival)


def _request_id(r: object) -> object:
    rid = getattr(r, "request_id", None)
    if rid is None:
        rid = getattr(getattr(r, "req", None), "request_id", None)
    return rid if rid is not None else id(r)


class SizeRule:
    """`ssjf`'s state and key (see the rule above). One per worker queue."""

    def __init__(self, input_weight: float = INPUT_WEIGHT, window_factor: float = WINDOW_FACTOR,
                 window_s: float = WINDOW_S, history: int = HISTORY, estimator: RemainingEstimator | None = None,
                 tail_guard: float = 0.0, overtake_bound: float = 0.0):
        if input_weight < 0 or window_factor <= 0 or window_s <= 0 or history < 1:
            raise ValueError("ssjf: input_weight >= 0, window_factor > 0, window_s > 0 and history >= 1 needed")
        self.input_weight, self.window_factor, self.window_s = input_weight, window_factor, window_s
        self.history = history
        self.estimator = estimator  # set: a waiting request's output estimate is E[L | predicted class]
        if not 0.0 <= tail_guard < 1.0:
            raise ValueError("ssjf: tail_guard is a quantile in [0, 1) (0 = off)")
        self.tail_guard = tail_guard
        if not 0.0 <= overtake_bound <= 1.0:
            raise ValueError("ssjf: overtake_bound is a share in [0, 1] (0 = off)")
        self.overtake_bound = overtake_bound
        self._jcts: deque[float] = deque(maxlen=GUARD_HISTORY)
        self._guard: float | None = None
        self._guard_new = 0
        self.completions = 0
        # completion times within the last tail JCT (overtake bound); pruned as the bound is read,
        # capped so that a worker whose order never reads it keeps no more than this
        self._done_at: deque[float] = deque(maxlen=1 << 16)
        self._tail: float | None = None  # the P99 of recent JCTs
        self._tail_new = 0
        self._due: OrderedDict[object, int] = OrderedDict()  # request -> the completion count FCFS starts it at
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

    def observe(self, jct_s: float, now: float | None = None) -> None:
        """A request completed `jct_s` seconds after it arrived, at `now` (default time.monotonic(),
        the clock of `arrival` in a live worker; the simulator passes its own): moves W and feeds
        the guards."""
        self._jct = jct_s if self._jct is None else (1 - JCT_EWMA) * self._jct + JCT_EWMA * jct_s
        if self.tail_guard or self.overtake_bound:
            self._jcts.append(jct_s)
            self._guard_new += 1
            self._tail_new += 1
        if self.overtake_bound:
            self.completions += 1
            self._done_at.append(time.monotonic() if now is None else now)

    def note_arrival(self, r: Queued, ahead: int) -> None:
        """The overtake bound's record of a request seen for the first time with `ahead` requests
        waiting that arrived before it: FCFS would start it about `ahead` completions from now."""
        rid = _queued_id(r)
        if rid not in self._due:
            self._due[rid] = self.completions + ahead
            if len(self._due) > 8 * self.history:
                self._due.popitem(last=False)

    def note_arrivals(self, waiting: Sequence[Queued]) -> None:
        """`note_arrival` for each request of the queue `waiting` not seen before."""
        due = self._due
        new = [r for r in waiting if _queued_id(r) not in due]
        if new:
            arrivals = sorted(r.arrival for r in waiting)
            for r in new:
                self.note_arrival(r, bisect_left(arrivals, r.arrival))

    def overtake_limit(self, now: float | None = None) -> int | None:
        """M: how many requests may overtake one (None while the bound is off or before GUARD_MIN
        completions): ⌈ε × the completions of the last P99-JCT seconds⌉, at least 1."""
        if not self.overtake_bound or len(self._jcts) < GUARD_MIN:
            return None
        if self._tail is None or self._tail_new >= GUARD_REFRESH:
            self._tail, self._tail_new = self._jct_quantile(TAIL_QUANTILE), 0
        done = self._done_at
        since = (time.monotonic() if now is None else now) - self._tail
        while done and done[0] < since:
            done.popleft()
        return max(1, math.ceil(self.overtake_bound * len(done)))

    def overtaken(self, r: Queued, limit: int | None) -> bool:
        """Whether more than `limit` (`overtake_limit`) requests have overtaken `r`: the worker has
        completed more than `limit` beyond the count at which FCFS would have started it."""
        if limit is None:
            return False
        due = self._due.get(_queued_id(r))
        return due is not None and self.completions > due + limit

    def guard(self) -> float | None:
        """Tail guard (seconds): a request that has waited longer than the `tail_guard` quantile of
        recent completions' JCT goes ahead of every request that has not, first come first served
        among such (the engine promotes it). None while off or before GUARD_MIN completions."""
        if not self.tail_guard or len(self._jcts) < GUARD_MIN:
            return None
        if self._guard is None or self._guard_new >= GUARD_REFRESH:
            self._guard, self._guard_new = self._jct_quantile(self.tail_guard), 0
        return self._guard

    def _jct_quantile(self, q: float) -> float:
        """The `q` quantile of the recent completions' JCTs (the guards' history)."""
        srt = sorted(self._jcts)
        return srt[min(len(srt) - 1, int(q * len(srt)))]

    def key_for(self, arrival: float, size: float) -> tuple[float, float]:
        """The key of a request of `size` that arrived at `arrival`, by the current ranks and W
        (no memo, no history): for a running request's refined remaining size."""
        rank = bisect_left(self._sorted, size) / len(self._sorted) if self._sorted else 0.5
        return (arrival + self.window * rank, arrival)

    def rekey(self, r: Queued, key: tuple[float, float]) -> None:
        """`r` sorts by `key` from now on (a paused request's refined key)."""
        self._memo[_queued_id(r)] = key

    @property
    def warm(self) -> bool:
        """Whether W follows completions yet (False: it is still the cold `window_s`)."""
        return self._jct is not None

    def key(self, r: Queued) -> tuple[float, float]:
        """Memoised once W follows completions. Keyed before the first completion, a request keeps
        its rank, not the cold W (120 s): its key is fixed with the first warm W. Fixed at the
        cold W, the long requests of a fresh worker's first burst sorted up to 120 s late.
        The simulator re-keys its waiting heap when the rule warms (`cluster._step_done`)."""
        rid = _queued_id(r)
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
