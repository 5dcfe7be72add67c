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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotation only: policy.py stays import-light
    from polyserve.core.perf import WorkerPerf


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """One request placed on a worker and not finished, as the dispatcher tracks it
    (Aladdin Table 1: l_in, l_pred, l_out so far, t_dec so far; CaraServe: its rank)."""

    request_id: str = ""
    input_tokens: int = 0
    predicted_tokens: int = 0  # l_pred (0 = unknown)
    generated: int = 0  # output tokens so far (l_out in Aladdin's Table 1)
    decode_ms: float = 0.0  # time spent in the decode phase so far (t_dec)
    started: bool = True  # False: placed but not yet prefilled (Aladdin's "new" requests)
    adapter: str | None = None
    rank: int = 0  # LoRA rank of its adapter (0 = base model)


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
    # --- used by Aladdin, CaraServe, least_loaded and first_fit (all optional) ---
    adapter_ranks: tuple[int, ...] = ()  # rank of each entry of `adapters`, same order
    max_adapters: int = 0  # adapter slots on the GPU; 0 = no limit
    kernel: str = "bgmv"  # LoRA kernel: "bgmv" (batch x max rank) | "mbgmv" (sum of ranks)
    max_batch: int = 0  # engine batch limit; 0 = unknown
    requests: tuple[RunningRequest, ...] = ()  # placed and unfinished, with lengths
    perf: WorkerPerf | None = None  # the worker's (fitted) performance models; None = unknown
    len_error: float = 0.0  # Aladdin Alg. 2 l^e from requests that finished before their prediction
    batch_error: float = 0.0  # Aladdin Alg. 2 b^e, same source

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
    adapter_rank: int = 0  # LoRA rank of `adapter` (0 = base model or unknown)
    ttft_slo_ms: float = 0.0  # 0 = the policy's default (Aladdin Table 2)
    atgt_slo_ms: float = 0.0  # time per output token SLO; 0 = the policy's default


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Per-deployment state a policy carries between calls."""

    last_worker: str = ""  # round-robin: the worker chosen last time


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker and the state to pass to the next call."""

    worker_id: str
    state: PolicyState
    scale_out: bool = False  # no worker met the policy's constraints: one more worker is wanted


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
    _require(workers)
    return Decision(min(workers, key=lambda w: (_token_load(w), _in_flight(w), w.worker_id)).worker_id, state)


FIRST_FIT_DEFAULT_BATCH = 64  # the sim engine's max_batch default, when a worker does not say


def first_fit(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
              rng: _random.Random) -> Decision:
    """First-fit bin packing (Punica, CaraServe §7.5 baseline): the first worker in worker_id
    order with a free batch slot and room in its KV cache for the request's input + predicted
    output; when none has room, the least loaded (`load_key`)."""
    _require(workers)
    need = request.input_tokens + request.predicted_tokens
    for w in sorted(workers, key=lambda w: w.worker_id):
        slots = w.max_batch or FIRST_FIT_DEFAULT_BATCH
        kv_ok = w.kv_capacity <= 0 or w.kv_used + need <= w.kv_capacity
        if _in_flight(w) < slots and kv_ok:
            return Decision(w.worker_id, state)
    return Decision(min(workers, key=load_key).worker_id, state)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "least_outstanding": least_outstanding,
    "power_of_two": power_of_two,
    "random": random_choice,
    "least_loaded": least_loaded,
    "first_fit": first_fit,
}
"""Policy name -> function. Deployment.policy must be one of these names."""

DEFAULT_POLICY = "least_outstanding"


def _register_model_policies() -> None:
    """Aladdin best-fit and CaraServe rank-aware live in their own modules (they import
    this one for the views); registered here so `POLICIES` names every policy. A module
    already being imported (it imported us first) registers itself when it is done."""
    import importlib
    import sys

    for module, name, attr in (("polyserve.dispatcher.policy_aladdin", "aladdin", "aladdin_best_fit"),
                               ("polyserve.dispatcher.policy_caraserve", "caraserve", "caraserve_rank_aware"),
                               ("polyserve.dispatcher.policy_arlo", "arlo_mlq", "arlo_mlq")):
        if module not in sys.modules:
            POLICIES.setdefault(name, getattr(importlib.import_module(module), attr))


_register_model_policies()


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
