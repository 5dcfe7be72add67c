"""Queue orders a worker (and the simulator) applies to its waiting requests, and the
head-of-line admission check (no I/O): the sim and hf engines, the simulator and the
tests call this very code. ssjf's size rule and its refinement live in
`polyserve.core.size_rule` (re-exported here); the performance models in `polyserve.core.perf`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from polyserve.core.length_classes import UNSEEN_MEDIANS  # noqa: F401 (re-exported)
from polyserve.core.size_rule import (  # noqa: F401 (re-exported: callers import queue_order alone)
    GUARD_HISTORY,
    GUARD_MIN,
    GUARD_REFRESH,
    HISTORY,
    INPUT_WEIGHT,
    JCT_EWMA,
    OVERTAKE_BOUND,
    PREEMPT_MARGIN,
    PREEMPT_QUANTUM,
    REFINE_HISTORY,
    REFINE_MIN_SAMPLES,
    REFINE_PRIOR,
    REFINE_REBUILD,
    TAIL_GUARD,
    TAIL_QUANTILE,
    UNKNOWN_CLASS,
    WINDOW_FACTOR,
    WINDOW_S,
    Preemptor,
    Q,
    Queued,
    RemainingEstimator,
    SizeRule,
    client_of,
    input_tokens_of,
    length_class_of,
    predicted_tokens_of,
    refined_ssjf_key,
)

# ------------------------------------------------------------------ queue order
OrderFn = Callable[[Sequence[Q]], list[Q]]


def fcfs(waiting: Sequence[Q]) -> list[Q]:
    """First come, first served (stable on equal arrival)."""
    return sorted(waiting, key=lambda r: r.arrival)


def priority_fcfs(waiting: Sequence[Q]) -> list[Q]:
    """Lower `priority` value first (vLLM convention), FCFS within a priority."""
    return sorted(waiting, key=lambda r: (r.priority, r.arrival))


# Speculative shortest-job-first, two rules (docs/experiments/sjf.md measures both).
# `ssjf` (the default): by expected size with a bounded overtake window and an overtake bound
# (`size_rule` gives the rule and why; `SizeRule` keeps its state, one per worker queue).
# `ssjf_class` (the earlier rule, µ-Serve §3.3/§3.5 aging): virtual arrival
#     arrival + length_class × aging_s,
# the class alone, no prompt term, no bound beyond the top class's offset.
AGING_S = 5.0


def fcfs_key(r: Queued) -> float:
    """Sort key of `fcfs`."""
    return r.arrival


def priority_key(r: Queued) -> tuple[int, float]:
    """Sort key of `priority_fcfs`."""
    return (r.priority, r.arrival)


DEFAULT_RULE = SizeRule(tail_guard=TAIL_GUARD, overtake_bound=OVERTAKE_BOUND)
"""The rule behind ORDERS["ssjf"] / ORDER_KEYS["ssjf"] in a live worker (one queue per process); the
engines feed it `DEFAULT_RULE.observe(jct)` on every completion (its window W and its guards)."""


def ssjf_key(r: Queued) -> tuple[float, float]:
    """Sort key of `speculative_sjf` (`DEFAULT_RULE`) while no request is overdue."""
    return DEFAULT_RULE.key(r)


def overdue(rule: SizeRule, r: Queued, now: float, limit: int | None = None) -> bool:
    """Past one of `rule`'s guards: overtaken by more than its overtake bound allows (`limit`: its
    `overtake_limit`, read here when not given), or waiting longer than its tail guard's JCT quantile."""
    g = rule.guard()
    if g is not None and now - r.arrival > g:
        return True
    return rule.overtaken(r, rule.overtake_limit(now) if limit is None else limit)


def guarded(rule: SizeRule, waiting: Sequence[Q], now: float | None = None) -> list[Q]:
    """`waiting` by `rule.key`, the overdue requests (`overdue`) first in arrival order. A static
    key cannot do this (whether a request is overdue changes as it waits): the order is made
    afresh at each admission. `now` on the clock of `arrival` (time.monotonic). New requests are
    noted for the overtake bound here (`SizeRule.note_arrivals`)."""
    now = time.monotonic() if now is None else now
    if rule.overtake_bound:
        rule.note_arrivals(waiting)
    g, m = rule.guard(), rule.overtake_limit(now)
    if g is None and m is None:
        return sorted(waiting, key=rule.key)
    return sorted(waiting, key=lambda r: (r.arrival - 1e12, r.arrival) if overdue(rule, r, now, m) else rule.key(r))


def speculative_sjf(waiting: Sequence[Q], now: float | None = None) -> list[Q]:
    """Speculative SJF by expected size (output + prompt cost) with a starvation bound (`ssjf_key`)
    and the overtake bound: overdue requests first, first come first served (`guarded`)."""
    return guarded(DEFAULT_RULE, waiting, now)


def make_ssjf(**params) -> tuple[SizeRule, OrderFn]:
    """A fresh `SizeRule` with other parameters and its order function (ValueError on a bad one);
    its guards act only where `tail_guard` or `overtake_bound` is given (the class's defaults are off)."""
    rule = SizeRule(**params)
    return rule, lambda waiting, now=None: guarded(rule, waiting, now)


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


def srpt_oracle_key(r: object, generated: int) -> tuple[int, float]:
    """Oracle shortest-remaining: true remaining output tokens (simulator only), then arrival."""
    return (r.true_tokens - generated, r.arrival)  # type: ignore[attr-defined]


REFINE_RULE = SizeRule(estimator=RemainingEstimator(by_client=True), tail_guard=TAIL_GUARD,
                       overtake_bound=OVERTAKE_BOUND)
"""The rule behind ORDERS["ssjf_refine"] in a live worker: ssjf with waiting requests sized by
E[L | client, predicted class] from the worker's own completions (the client: the API key's
tenant, `GenerateRequest.tenant`; requests without one use the class tables alone); the engine feeds
`REFINE_RULE.observe(jct)` and `REFINE_RULE.estimator.observe(...)` and pauses running
requests with a `Preemptor` (the `sim` and `hf` engines do; the key of a paused request is set with
`SizeRule.rekey`)."""


def refine_pauses(preemptor: Preemptor, running: Sequence[tuple[Q, int, int]], heads: Sequence[object],
                  now: float | None = None) -> list[Q]:
    """ssjf_refine's pauses in a live engine (the sim and hf engines): `running` as (request,
    tokens it generated, decode steps since it was (re)admitted), `heads` the waiting requests
    in queue order that could take a freed place. Overdue requests (`overdue`) are never paused.
    Returns the requests to pause, each re-keyed under its refined key (`SizeRule.rekey`) for the
    queue it goes back to; the engine sets them aside."""
    rule = REFINE_RULE
    now = time.monotonic() if now is None else now
    limit = rule.overtake_limit(now)
    keyed = [(refined_ssjf_key(rule, rule.estimator, r, generated), steps, r) for r, generated, steps in running
             if not overdue(rule, r, now, limit)]
    keys = [rule.key(w) for w in heads[:len(keyed)]]
    victims = preemptor.victims(keyed, keys, PREEMPT_MARGIN * rule.window)
    for r in victims:
        rule.rekey(r, next(k for k, _, x in keyed if x is r))
    return victims


def speculative_sjf_refine(waiting: Sequence[Q], now: float | None = None) -> list[Q]:
    """`ssjf` on refined sizes (`REFINE_RULE`), overdue requests (`overdue`) first in arrival
    order; the engine adds the preemption. `now` on the clock of `arrival` (time.monotonic)."""
    return guarded(REFINE_RULE, waiting, now)


ORDERS: dict[str, OrderFn] = {"fcfs": fcfs, "priority": priority_fcfs, "ssjf": speculative_sjf,
                              "ssjf_class": speculative_sjf_class, "ssjf_refine": speculative_sjf_refine}
"""Queue orders a live engine may use (the worker setting `scheduling` names one)."""

ORDER_KEYS: dict[str, Callable[[Queued], object]] = {"fcfs": fcfs_key, "priority": priority_key,
                                                     "ssjf": ssjf_key, "ssjf_class": ssjf_class_key,
                                                     "sjf_oracle": oracle_key}
"""Each order as a static sort key (`sorted(waiting, key=ORDER_KEYS[name])` == `ORDERS[name]`; for
`ssjf`, while no request is overdue); includes the simulator-only `sjf_oracle`. Static
keys let a simulator keep a heap: it promotes overdue requests from a second heap, by arrival."""


# ------------------------------------------------------------------ admission
class Candidate(Protocol):
    """What admission looks at: batch slots (one per sequence) and KV demand."""

    seqs: int
    kv_demand: int


class Held(NamedTuple):
    """A paused request as admission sees it: batch slots, but no new KV (it kept its own)."""

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
    return stop_span(text, stops, start)[0]


def stop_span(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, int]:
    """(start, end) of the earliest stop string in `text` at or after `start` (the longest of those
    starting there), or (-1, -1)."""
    best, end = -1, -1
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos >= 0 and (best < 0 or pos < best or (pos == best and pos + len(stop) > end)):
            best, end = pos, pos + len(stop)
    return best, end
