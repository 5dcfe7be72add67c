"""What dispatch policies see: immutable views of workers and requests, the policy's own
state and its decision. Every policy module imports these from here (and `policy`
re-exports them), so the policy modules never import each other's registries.

Every policy has the signature of `Policy`::

    policy(workers, request, state, rng) -> Decision

* ``workers``: the candidate workers (non-empty, already filtered to the
  deployment, live, not excluded), as immutable `WorkerView`s;
* ``request``: what is known of the request (`RequestView`);
* ``state``: the policy's own state for this deployment, passed in and returned
  in the `Decision` (round-robin's position) so the caller keeps it, not the
  function;
* ``rng``: a `random.Random` for randomised policies (seed it to replay).
"""
from __future__ import annotations

import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from polyserve.core.perf import WorkerPerf

# `RunningRequest`, `WorkerView` and `RequestView` are immutable by convention, not `frozen`:
# the dispatcher builds one or two of them per placement, and a frozen dataclass's __init__
# sets each field through `object.__setattr__` (2.7 µs for WorkerView's 18 fields on the
# 2-core bench machine, 0.36 µs unfrozen; see docs/benchmarks/dispatch.md, "allocation-free
# placements"). Nothing assigns to their fields (change one with `dataclasses.replace`);
# `unsafe_hash=True` keeps them hashable by value as frozen ones were.


@dataclass(slots=True, unsafe_hash=True)
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
    max_tokens: int = 0  # hard cap on its output (0 = unknown): no plan counts more output than this


@dataclass(slots=True, unsafe_hash=True)
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


@dataclass(slots=True, unsafe_hash=True)
class RequestView:
    """What policies may use of a request."""

    request_id: str = ""
    input_tokens: int = 0
    predicted_tokens: int = 0  # the live dispatcher clamps it to `max_tokens` (when > 0)
    length_class: int = -1
    adapter: str | None = None
    priority: int = 0
    adapter_rank: int = 0  # LoRA rank of `adapter` (0 = base model or unknown)
    ttft_slo_ms: float = 0.0  # 0 = the policy's default (Aladdin Table 2); live: the deployment's
    atgt_slo_ms: float = 0.0  # time per output token SLO; 0 = the policy's default
    max_tokens: int = 0  # hard cap on the output (0 = unknown)


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Per-deployment state a policy carries between calls."""

    last_worker: str = ""  # round-robin: the worker chosen last time


@dataclass(slots=True, unsafe_hash=True)  # immutable by convention too: one per decision (0.55 -> 0.2 µs)
class Decision:
    """The chosen worker and the state to pass to the next call."""

    worker_id: str
    state: PolicyState
    scale_out: bool = False  # no worker met the policy's constraints: one more worker is wanted


Policy = Callable[[Sequence[WorkerView], RequestView, PolicyState, _random.Random], Decision]


def load_key(w: WorkerView) -> tuple[int, int, float, str]:
    """Join-the-shortest-queue order: own outstanding + engine waiting, then running,
    then fuller KV cache last, then worker_id (deterministic tie-break)."""
    return (w.outstanding + w.waiting, w.running, -w.kv_free_fraction, w.worker_id)


def require_workers(workers: Sequence[WorkerView]) -> None:
    """ValueError when a policy is asked to choose among no workers."""
    if not workers:
        raise ValueError("a dispatch policy needs at least one candidate worker")
