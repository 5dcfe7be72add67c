"""Placement in the gateway itself, for the dispatch policies that read nothing but worker
load (issue 15: fewer hops on the critical path).

`round_robin`, `least_outstanding`, `power_of_two` and `random` decide from the live workers'
heartbeats and the requests in flight; none reads the prediction or keeps per-request books.
For them a round trip to the dispatcher (two NATS messages, a wake-up of another process and
~1 ms at concurrency 1 on two cores) buys nothing the gateway does not know better itself: it
counts its own requests in flight on each worker exactly, and learns the rest of each worker's
load (other gateways' requests) from the worker's heartbeat. The dispatcher still hears of every
placement through the `dispatched` event (its shared accounting, issue 13) and still places
what needs it: the model-based and packing policies, LoRA requests (adapter placement is its
job) and everything while the gateway has no fresh heartbeat of the deployment.
`local_dispatch = false` (setting) sends every request to the dispatcher as before.

The same counts serve the fallback when no dispatcher answers (`admission.local_placement`).

Cache affinity (`prompt_cache_key`): requests that carry the same key (per tenant) go to the same
worker, so a vLLM worker finds their shared prompt prefix in its cache, unless that worker is
overloaded: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018),
here by rendezvous hashing (`LocalRouter.affine`). Without a key, prompts that start alike meet
on one worker under the same bound (prefixes.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence

from polyserve.proto import Heartbeat

LOCAL_POLICIES = frozenset({"round_robin", "least_outstanding", "power_of_two", "random"})
# Requests a key's worker may hold beyond factor x the mean load: at low load the bound alone
# (ceil(1.25 x 2 / 3) = 1 with two requests on three workers) would split every key; an absolute
# margin as SGLang's cache-aware router has (its balance_abs_threshold)
AFFINITY_SLACK = 4


class LocalRouter:
    """Each live worker's load as this gateway sees it, and the load-only policies over it."""

    def __init__(self, seed: int | None = None):
        self.own: dict[str, int] = {}  # worker -> requests of this gateway on it, not ended yet
        self._where: dict[str, str] = {}  # request_id -> the worker it counts against
        # worker -> running + waiting at its last heartbeat that were not this gateway's
        # (other gateways' requests; a snapshot, refreshed by the next heartbeat)
        self.others: dict[str, int] = {}
        self._last: dict[str, str] = {}  # deployment -> worker chosen last (round_robin)
        self._rng = random.Random(seed)

    # ------------------------------------------------------------------ accounting
    def assign(self, request_id: str, worker_id: str) -> None:
        """`request_id` runs on `worker_id` now (idempotent; a move counts once). Done at the
        moment of choice: concurrent requests must see each other before anything awaits."""
        old = self._where.get(request_id)
        if old == worker_id:
            return
        if old:
            self._drop(old)
        self._where[request_id] = worker_id
        self.own[worker_id] = self.own.get(worker_id, 0) + 1

    def release(self, request_id: str) -> None:
        """`request_id` ended (or never ran): it no longer counts against a worker."""
        old = self._where.pop(request_id, None)
        if old:
            self._drop(old)

    def _drop(self, worker_id: str) -> None:
        left = self.own.get(worker_id, 0) - 1
        if left > 0:
            self.own[worker_id] = left
        else:
            self.own.pop(worker_id, None)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        # What the worker reports beyond this gateway's own requests. Clamped at 0: a request
        # published a moment ago may not have reached the worker when it sent the heartbeat.
        self.others[hb.worker_id] = max(0, hb.running + hb.waiting - self.own.get(hb.worker_id, 0))

    def forget(self, worker_id: str) -> None:
        self.others.pop(worker_id, None)

    def load(self, hb: Heartbeat) -> int:
        """Requests on the worker now: this gateway's (exact) plus the others' (last heartbeat)."""
        return self.own.get(hb.worker_id, 0) + self.others.get(hb.worker_id, 0)

    def _key(self, hb: Heartbeat) -> tuple[int, float, str]:
        # the dispatcher's join-the-shortest-queue order (dispatcher/views.load_key): load, then
        # the emptier KV cache, then worker_id, so that ties are broken the same everywhere
        kv = hb.kv_used / hb.kv_capacity if hb.kv_capacity > 0 else 0.0
        return self.load(hb), kv, hb.worker_id

    # ------------------------------------------------------------------ policies
    def choose(self, policy: str, deployment: str, workers: Sequence[Heartbeat]) -> Heartbeat:
        """The worker `policy` picks among `workers` (non-empty; already filtered to those
        that can take the request)."""
        if policy == "round_robin":
            ids = sorted(workers, key=lambda hb: hb.worker_id)
            last = self._last.get(deployment, "")
            hb = next((w for w in ids if w.worker_id > last), ids[0])
            self._last[deployment] = hb.worker_id
            return hb
        if policy == "random":
            return self._rng.choice(list(workers))
        if policy == "power_of_two" and len(workers) > 2:
            return min(self._rng.sample(list(workers), 2), key=self._key)
        return self.least(workers)  # least_outstanding, and power_of_two of <= 2

    def affine(self, key: str, workers: Sequence[Heartbeat], factor: float) -> Heartbeat:
        """The worker for affinity `key` among `workers` (non-empty): the workers ranked by a hash of
        (key, worker id), the first whose load with this request stays within `factor` x the mean
        load (rounded up) plus AFFINITY_SLACK. A key keeps its worker while that worker is not
        overloaded, and moves to the same second choice when it is; a worker that comes or goes
        moves only the keys that rank it first."""
        return self.first_within(ranked_for(key, workers), factor)

    def first_within(self, ranked: Sequence[Heartbeat], factor: float) -> Heartbeat:
        """The first of `ranked` (a key's order, `ranked_for`) whose load with one more request stays
        within the bound of `affine`."""
        bound = self._bound(ranked, factor)
        return next((hb for hb in ranked if self.load(hb) + 1 <= bound), ranked[0])

    def within(self, hb: Heartbeat, workers: Sequence[Heartbeat], factor: float) -> bool:
        """Whether `hb` (one of `workers`) takes one more request within the bound of `affine`."""
        return self.load(hb) + 1 <= self._bound(workers, factor)

    def least(self, workers: Sequence[Heartbeat]) -> Heartbeat:
        """The least loaded of `workers` (non-empty), ties broken as the dispatcher breaks them."""
        return min(workers, key=self._key)

    def _bound(self, workers: Sequence[Heartbeat], factor: float) -> int:
        return math.ceil(factor * (sum(self.load(hb) for hb in workers) + 1) / len(workers)) + AFFINITY_SLACK


def ranked_for(key: str, workers: Sequence[Heartbeat]) -> list[Heartbeat]:
    """`workers` in affinity `key`'s order (rendezvous hashing): the first is the key's home."""
    return sorted(workers, key=lambda hb: _weight(key, hb.worker_id), reverse=True)


def affinity(tenant: str, key: str) -> str:
    """A request's affinity from its `prompt_cache_key` ("" = none): a hash of (tenant, key), so
    that equal keys of two tenants are unrelated."""
    return hashlib.blake2b(json.dumps([tenant, key]).encode(), digest_size=8).hexdigest() if key else ""


def _weight(key: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest()


def candidates(live: Sequence[Heartbeat], input_tokens: int, exclude: Sequence[str]) -> list[Heartbeat]:
    """The live workers that can take a request of `input_tokens` and are not excluded."""
    return [hb for hb in live if hb.worker_id not in exclude
            and (hb.max_input_len <= 0 or input_tokens <= hb.max_input_len)]
