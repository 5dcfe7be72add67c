"""Dispatch policies as pure functions (no I/O): data in, decision out.

Every policy has the signature of `Policy`::

    policy(workers, request, state, rng) -> Decision

* ``workers``: the candidate workers (non-empty, already filtered to the
  deployment, live, not excluded), as immutable `WorkerView`s;
* ``request``: what is known of the request (`RequestView`);
* ``state``: the policy's own state for this deployment, passed in and returned
  in the `Decision` (round-robin's position) so the caller keeps it, not the
  function;
* ``rng``: a `random.Random` for randomised policies (seed it to replay).

The gateway validates a deployment's policy name against `POLICIES`; the
simulator and the dispatcher call the very same functions.
"""
from __future__ import annotations

import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the dispatcher knows of one worker: its last heartbeat plus its own accounting."""

    worker_id: str
    outstanding: int = 0  # placed by this dispatcher and not yet completed/failed
    running: int = 0  # engine-reported, from the heartbeat
    waiting: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    max_input_len: int = 0  # 0 = no limit
    gpu_id: str = ""
    adapters: tuple[str, ...] = ()

    @property
    def kv_free_fraction(self) -> float:
        """Free share of the KV cache (1.0 when the capacity is unknown)."""
        if self.kv_capacity <= 0:
            return 1.0
        return max(0.0, 1.0 - self.kv_used / self.kv_capacity)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What policies may use of a request."""

    request_id: str = ""
    input_tokens: int = 0
    predicted_tokens: int = 0
    length_class: int = -1
    adapter: str | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Per-deployment state a policy carries between calls."""

    last_worker: str = ""  # round-robin: the worker chosen last time


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker and the state to pass to the next call."""

    worker_id: str
    state: PolicyState


Policy = Callable[[Sequence[WorkerView], RequestView, PolicyState, _random.Random], Decision]


class UnknownPolicy(ValueError):
    """A policy name that is not in `POLICIES`; the message lists the known names."""

    def __init__(self, name: str):
        super().__init__(f"unknown dispatch policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
        self.name = name


def load_key(w: WorkerView) -> tuple[int, int, float, str]:
    """Join-the-shortest-queue order: own outstanding + engine waiting, then running,
    then fuller KV cache last, then worker_id (deterministic tie-break)."""
    return (w.outstanding + w.waiting, w.running, -w.kv_free_fraction, w.worker_id)


def _require(workers: Sequence[WorkerView]) -> None:
    if not workers:
        raise ValueError("a dispatch policy needs at least one candidate worker")


def round_robin(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                rng: _random.Random) -> Decision:
    """The next worker after the last one chosen, in worker_id order (stable when workers come and go)."""
    _require(workers)
    ids = sorted(w.worker_id for w in workers)
    chosen = next((i for i in ids if i > state.last_worker), ids[0])
    return Decision(chosen, replace(state, last_worker=chosen))


def least_outstanding(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                      rng: _random.Random) -> Decision:
    """JSQ: the worker with the fewest outstanding + waiting requests (ties: `load_key`)."""
    _require(workers)
    return Decision(min(workers, key=load_key).worker_id, state)


def power_of_two(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                 rng: _random.Random) -> Decision:
    """Power of two choices (Mitzenmacher): two workers at random, the less loaded of them."""
    _require(workers)
    if len(workers) == 1:
        return Decision(workers[0].worker_id, state)
    a, b = rng.sample(list(workers), 2)
    return Decision(min(a, b, key=load_key).worker_id, state)


def random_choice(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                  rng: _random.Random) -> Decision:
    """Uniformly random worker (baseline)."""
    _require(workers)
    return Decision(rng.choice(list(workers)).worker_id, state)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "least_outstanding": least_outstanding,
    "power_of_two": power_of_two,
    "random": random_choice,
}
"""Policy name -> function. Deployment.policy must be one of these names."""

DEFAULT_POLICY = "least_outstanding"


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
