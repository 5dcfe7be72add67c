"""Dispatch policies as pure functions (no I/O): data in, decision out, and `POLICIES`,
the one registry of them.

The signature every policy has (`Policy`) and the views it reads (`WorkerView`,
`RequestView`, `PolicyState`, `Decision`) are in `views` and re-exported here. This
module holds the simple policies; Aladdin best-fit, CaraServe rank-aware and Arlo's
scheduler live in `policy_aladdin`, `policy_caraserve` and `policy_arlo`, which import
`views` only: `POLICIES` below imports all three explicitly and is frozen (a
`MappingProxyType`), its names exactly `polyserve.core.names.DISPATCH_POLICIES`. The
gateway validates a deployment's policy against those names; the simulator and the
dispatcher call the very same functions.
"""
from __future__ import annotations

import random as _random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from polyserve.core.names import DEFAULT_POLICY, DISPATCH_POLICIES
from polyserve.dispatcher import policy_aladdin, policy_arlo, policy_caraserve
from polyserve.dispatcher.views import (
    Decision,
    Policy,
    PolicyState,
    RequestView,
    RunningRequest,
    WorkerView,
    load_key,
    require_workers,
)

__all__ = [
    "DEFAULT_POLICY", "POLICIES", "Decision", "Policy", "PolicyState", "RequestView", "RunningRequest",
    "UnknownPolicy", "WorkerView", "choose", "first_fit", "get_policy", "least_loaded", "least_outstanding",
    "load_key", "power_of_two", "random_choice", "round_robin",
]


class UnknownPolicy(ValueError):
    """A policy name that is not in `POLICIES`; the message lists the known names."""

    def __init__(self, name: str):
        super().__init__(f"unknown dispatch policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
        self.name = name


def round_robin(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                rng: _random.Random) -> Decision:
    """The next worker after the last one chosen, in worker_id order (stable when workers come and go)."""
    require_workers(workers)
    ids = sorted(w.worker_id for w in workers)
    chosen = next((i for i in ids if i > state.last_worker), ids[0])
    return Decision(chosen, replace(state, last_worker=chosen))


def least_outstanding(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                      rng: _random.Random) -> Decision:
    """JSQ: the worker with the fewest outstanding + waiting requests (ties: `load_key`)."""
    require_workers(workers)
    return Decision(min(workers, key=load_key).worker_id, state)


def power_of_two(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                 rng: _random.Random) -> Decision:
    """Power of two choices (Mitzenmacher): two workers at random, the less loaded of them."""
    require_workers(workers)
    if len(workers) == 1:
        return Decision(workers[0].worker_id, state)
    a, b = rng.sample(list(workers), 2)
    return Decision(min(a, b, key=load_key).worker_id, state)


def random_choice(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                  rng: _random.Random) -> Decision:
    """Uniformly random worker (baseline)."""
    require_workers(workers)
    return Decision(rng.choice(list(workers)).worker_id, state)


def _in_flight(w: WorkerView) -> int:
    return max(w.outstanding, w.running + w.waiting, len(w.requests))


def _token_load(w: WorkerView) -> float:
    """Tokens of work still held by a worker: Σ(input + predicted output) of its requests
    when the dispatcher tracks them, else its KV use (fraction), else its queue."""
    if w.requests:
        return float(sum(r.input_tokens + max(r.predicted_tokens, r.generated) for r in w.requests))
    if w.kv_capacity > 0:
        return w.kv_used / w.kv_capacity * 1e6
    return float(_in_flight(w))


def least_loaded(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                 rng: _random.Random) -> Decision:
    """MostIdle (CaraServe §7.5 baseline): the worker with the least work in tokens
    (`_token_load`), ties by requests in flight, then worker_id."""
    require_workers(workers)
    return Decision(min(workers, key=lambda w: (_token_load(w), _in_flight(w), w.worker_id)).worker_id, state)


FIRST_FIT_DEFAULT_BATCH = 64  # the sim engine's max_batch default, when a worker does not say


def first_fit(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
              rng: _random.Random) -> Decision:
    """First-fit bin packing (Punica, CaraServe §7.5 baseline): the first worker in worker_id
    order with a free batch slot and room in its KV cache for the request's input + predicted
    output; when none has room, the least loaded (`load_key`)."""
    require_workers(workers)
    need = request.input_tokens + request.predicted_tokens
    for w in sorted(workers, key=lambda w: w.worker_id):
        slots = w.max_batch or FIRST_FIT_DEFAULT_BATCH
        kv_ok = w.kv_capacity <= 0 or w.kv_used + need <= w.kv_capacity
        if _in_flight(w) < slots and kv_ok:
            return Decision(w.worker_id, state)
    return Decision(min(workers, key=load_key).worker_id, state)


def _registry() -> Mapping[str, Policy]:
    """Every policy by name, in `DISPATCH_POLICIES` order; refuses to build a registry
    that names other policies than the vocabulary does."""
    by_name: dict[str, Policy] = {
        "round_robin": round_robin,
        "least_outstanding": least_outstanding,
        "power_of_two": power_of_two,
        "random": random_choice,
        "least_loaded": least_loaded,
        "first_fit": first_fit,
        "aladdin": policy_aladdin.aladdin_best_fit,
        "caraserve": policy_caraserve.caraserve_rank_aware,
        **policy_arlo.ARLO_POLICIES,
    }
    if set(by_name) != set(DISPATCH_POLICIES):
        raise RuntimeError(f"dispatch policies {sorted(by_name)} differ from core.names.DISPATCH_POLICIES")
    return MappingProxyType({name: by_name[name] for name in DISPATCH_POLICIES})


POLICIES: Mapping[str, Policy] = _registry()
"""Policy name -> function, read-only. Deployment.policy must be one of these names."""


def get_policy(name: str) -> Policy:
    """The policy called `name`; UnknownPolicy (a ValueError) lists the known names."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicy(name) from None


def choose(policy_name: str, workers: Sequence[WorkerView], request: RequestView,
           state: PolicyState, rng: _random.Random) -> Decision:
    """Run the named policy over `workers`."""
    return get_policy(policy_name)(workers, request, state, rng)
