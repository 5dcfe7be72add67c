"""Arlo's request scheduler (§3.4, Alg. 1) and its §5.2.3 baselines, as pure dispatch policies.

Polymorphing serves one encoder model with several runtimes, each compiled for a
static `max_length`; a worker hosts one runtime and says its length in
`WorkerView.max_input_len` (0 = no limit, a dynamic-shape runtime). The
*levels* of the multi-level queue are the runtimes ordered by `max_length`;
within a level the *head* is the instance with the least congestion
``P = N / M`` where

* ``N`` = the instance's outstanding requests (queued + executing): the
  dispatcher's own count of placements not yet completed (`outstanding`);
* ``M`` = its capacity within the SLO (Arlo §3.3's M_i): encoder workers report
  it as a token budget, ``kv_capacity = M × max_input_len`` (see
  `worker/engines/encoder.py`), so ``M = kv_capacity // max_input_len``; a
  worker without one falls back to `max_batch`, else `DEFAULT_CAPACITY`.

Policies (signature of `polyserve.dispatcher.policy.Policy`):

* ``arlo_mlq`` — Alg. 1: candidate levels are those whose max_length fits the
  request, in increasing order, at most ``L`` of them; the first whose head has
  ``P < λ`` takes the request, the threshold decaying ``λ ← λ·α`` per level;
  when none qualifies the ideal (first) level's head does. Defaults λ = 0.85,
  α = 0.9, L = 6 (§5 parameter settings). `make_arlo_mlq` builds other settings.
* ``arlo_ilb`` — Intra-group Load Balance: the ideal runtime (least padding),
  its least-loaded instance.
* ``arlo_ig`` — Inter-groups Greedy: the least busy (lowest ``P``) instance
  among all candidate runtimes; ties go to the shorter runtime.

A request longer than every runtime (the dispatcher filters those out before a
policy runs, the simulator may not) goes to the longest runtime.
"""
from __future__ import annotations

import math
import random as _random
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from polyserve.dispatcher.views import Decision, Policy, PolicyState, RequestView, WorkerView

DEFAULT_LAMBDA = 0.85
DEFAULT_ALPHA = 0.9
DEFAULT_LEVELS = 6
DEFAULT_CAPACITY = 8


def runtime_length(w: WorkerView) -> float:
    """The worker's runtime max_length; a worker without a limit sorts last (infinite)."""
    return float(w.max_input_len) if w.max_input_len > 0 else math.inf


def capacity(w: WorkerView) -> int:
    """M_i: requests the instance holds within its SLO (see the module docstring)."""
    if w.kv_capacity > 0 and w.max_input_len > 0:
        return max(1, w.kv_capacity // w.max_input_len)
    if w.max_batch > 0:
        return w.max_batch
    return DEFAULT_CAPACITY


def congestion(w: WorkerView) -> float:
    """P = N / M of Alg. 1 (lines 7-9)."""
    return w.outstanding / capacity(w)


def _head_key(w: WorkerView) -> tuple[float, int, str]:
    return (congestion(w), w.outstanding, w.worker_id)


def levels(workers: Sequence[WorkerView], input_tokens: int) -> list[tuple[float, list[WorkerView]]]:
    """Candidate levels for a request of `input_tokens`: (max_length, instances) of every
    runtime that fits it, shortest first; only the longest runtime when none fits."""
    if not workers:
        raise ValueError("a dispatch policy needs at least one candidate worker")
    by_len: dict[float, list[WorkerView]] = {}
    for w in workers:
        by_len.setdefault(runtime_length(w), []).append(w)
    ordered = sorted(by_len.items())
    fit = [(n, ws) for n, ws in ordered if n >= input_tokens]
    return fit or [ordered[-1]]


def head(instances: Sequence[WorkerView]) -> WorkerView:
    """The level's priority-queue head: least congestion, then fewest outstanding, then id."""
    return min(instances, key=_head_key)


def make_arlo_mlq(lam: float = DEFAULT_LAMBDA, alpha: float = DEFAULT_ALPHA,
                  max_levels: int = DEFAULT_LEVELS) -> Policy:
    """Alg. 1 with threshold `lam`, decay `alpha` and at most `max_levels` peeked levels."""
    if not 0 < lam or not 0 < alpha <= 1 or max_levels < 1:
        raise ValueError("need lam > 0, 0 < alpha <= 1 and max_levels >= 1")

    def arlo_mlq(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                 rng: _random.Random) -> Decision:
        candidates = levels(workers, request.input_tokens)[:max_levels]
        threshold = lam
        for _, instances in candidates:
            h = head(instances)
            if congestion(h) < threshold:
                return Decision(h.worker_id, state)
            threshold *= alpha  # demote more reluctantly the further from the ideal runtime
        return Decision(head(candidates[0][1]).worker_id, state)

    arlo_mlq.__doc__ = (f"Arlo MLQ (Alg. 1): first candidate level whose head has P < λ "
                        f"(λ={lam}, ×{alpha} per level, at most {max_levels} levels), else the ideal level.")
    return arlo_mlq


arlo_mlq = make_arlo_mlq()


def arlo_ilb(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
             rng: _random.Random) -> Decision:
    """ILB (§5.2.3): the ideal runtime (least padding), its least-loaded instance."""
    _, instances = levels(workers, request.input_tokens)[0]
    return Decision(min(instances, key=lambda w: (w.outstanding, congestion(w), w.worker_id)).worker_id,
                    state)


def arlo_ig(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
            rng: _random.Random) -> Decision:
    """IG (§5.2.3): the least busy instance (lowest P) among all candidate runtimes."""
    best = min((w for _, ws in levels(workers, request.input_tokens) for w in ws),
               key=lambda w: (congestion(w), runtime_length(w), w.outstanding, w.worker_id))
    return Decision(best.worker_id, state)


ARLO_POLICIES: Mapping[str, Policy] = MappingProxyType({"arlo_mlq": arlo_mlq, "arlo_ilb": arlo_ilb,
                                                         "arlo_ig": arlo_ig})
"""Name -> policy, read-only; `polyserve.dispatcher.policy.POLICIES` includes them."""
