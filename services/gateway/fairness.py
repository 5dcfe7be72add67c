"""Fair sharing under contention: the Virtual Token Counter (VTC) of "Fairness in Serving Large
Language Models" (Sheng et al., OSDI'24; AIBrix ships it as `vtc`), as a queue in the gateway in
front of dispatch, per deployment, with priority classes on top.

Why here, not as a `priority` for the workers' queues: a worker orders only the requests already
sent to it, and only with `scheduling=priority`; the sim, hf, vllm and openai-http engines differ
in what they do with a priority, and a number fixed at dispatch cannot follow a counter that moves
as tenants are served. The gateway sees every request of its clients before any is placed, so it
holds back what the deployment cannot start now and lets the next request go by VTC's rule.

How: a deployment has `slots` (by default the batch slots of its live workers, `max_batch` from
their heartbeats; setting `fair_slots`). While fewer than `slots` of this gateway's requests run,
a request goes at once. Beyond that it waits; when a slot frees, the waiting request of the
highest priority class goes, and within a class the one of the tenant with the smallest counter
(FIFO within a tenant). A tenant's counter grows by w_in × input tokens + w_out × output tokens
(the paper's weights 1 and 2) for each request it starts: the estimate when the request starts,
corrected with the actual usage when it ends. A tenant that becomes backlogged is lifted to the
smallest counter of the backlogged tenants (or of those running, when none waits), so idle time
banks no credit (VTC Algorithm 2). With several gateways, each orders its own clients' requests;
the counters are per gateway.

The reserve: nothing is preempted, so a tenant that arrives while another holds every batch slot
waits for one of those sequences to end, and sequences started together end together (a whole
heavy request's decode time). So while two or more tenants are active, the last
`reserve_fraction` of the slots (at least one, at most one per other active tenant) go only to a
tenant holding fewer than its equal share (slots / active tenants): a heavy tenant runs at most slots - reserve, and a light tenant's
request starts in the worker's next iteration. The cost: those slots idle while no light tenant
uses them (`polyserve bench fairness` prints the heavy tenant's throughput with and without)."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

W_IN, W_OUT = 1.0, 2.0  # VTC's weights for input and output tokens (paper §4)
CONTENTION_WINDOW_S = 2.0  # tenants seen this recently count as contending (admission.fair_slots)
CLASS_RANK = {"high": 0, "normal": 1, "low": 2}
RESERVE_FRACTION = 0.125  # of the slots kept for tenants under their share (gateway setting fair_reserve)


@dataclass
class Grant:
    """A started request holding one of the deployment's slots (until `FairQueue.release`)."""

    queue: "FairQueue"
    tenant: str
    charged: float  # counter units charged at start (estimate)
    waited_s: float = 0.0
    released: bool = False
    ahead: bool = False  # its tenant had nothing running while another did: first in a priority-aware worker


@dataclass(order=True)
class _Waiter:
    seq: int
    tenant: str = field(compare=False)
    rank: int = field(compare=False)
    cost: float = field(compare=False)
    future: asyncio.Future = field(compare=False)


class FairQueue:
    """The VTC queue of one deployment on this gateway."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.running: dict[str, int] = {}  # tenant -> requests holding a slot
        self.waiting: dict[str, deque[_Waiter]] = {}
        self._seq = itertools.count()
        self.slots = 0  # the last known capacity (admission.fair_slots)
        self.last_seen: dict[str, float] = {}  # tenant -> monotonic time of its last request
        self.reserve_fraction = RESERVE_FRACTION
        self.born = time.monotonic()  # the first request seen (admission.fair_slots' headroom waits a window)

    def active(self, window_s: float = CONTENTION_WINDOW_S) -> int:
        """How many tenants sent requests within `window_s` (or run or wait now)."""
        now = time.monotonic()
        seen = {t for t, at in self.last_seen.items() if now - at <= window_s}
        return len(seen | set(self.running) | set(self.waiting))

    def contended(self, window_s: float = CONTENTION_WINDOW_S) -> bool:
        """Whether two or more tenants sent requests within `window_s` (or run or wait now), or
        this queue is younger than that: a deployment just started may see its tenants arrive
        over a window, and headroom given to the first would queue in the worker ahead of the rest."""
        return self.active(window_s) >= 2 or time.monotonic() - self.born < window_s

    def _limit(self, slots: int, active: int) -> tuple[int, float]:
        """(slots any tenant may fill, the share below which a tenant may fill the reserve too)."""
        if active < 2 or slots < 2 or self.reserve_fraction <= 0:
            return slots, 0.0
        # one slot per other active tenant at most: two tenants on a 64-slot batch idle 1, not 8
        reserve = min(slots - 1, max(1, int(slots * self.reserve_fraction)), active - 1)
        return slots - reserve, slots / active

    def _may_start(self, tenant: str, slots: int, limit: int, share: float) -> bool:
        return self.busy < limit or (self.busy < slots and self.running.get(tenant, 0) < share)

    @property
    def busy(self) -> int:
        return sum(self.running.values())

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def _lift(self, tenant: str) -> None:
        """A tenant that becomes backlogged starts at the smallest counter of the active tenants."""
        active = [self.counters.get(t, 0.0) for t, q in self.waiting.items() if q]
        if not active:
            active = [self.counters.get(t, 0.0) for t, n in self.running.items() if n and t != tenant]
        if active:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(active))

    def _start(self, tenant: str, cost: float) -> Grant:
        ahead = not self.running.get(tenant) and self.busy > 0
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        self.running[tenant] = self.running.get(tenant, 0) + 1
        return Grant(self, tenant, cost, ahead=ahead)

    async def acquire(self, tenant: str, klass: str, est_in: int, est_out: int, slots: int) -> Grant:
        """Wait (cancellable) until the request may start; a Grant to `release` when it ends."""
        cost = W_IN * est_in + W_OUT * est_out
        self.last_seen[tenant] = time.monotonic()
        if len(self.last_seen) > 10_000:  # forget tenants gone quiet (memory stays bounded)
            self.last_seen = {t: at for t, at in self.last_seen.items()
                              if self.last_seen[tenant] - at <= CONTENTION_WINDOW_S}
        idle = not self.waiting.get(tenant) and not self.running.get(tenant)
        if idle:
            self._lift(tenant)
        # A tenant with nothing running or waiting would be next anyway (lifted to the smallest
        # counter, fewest running): it starts now, even over the slots (by at most one request
        # per such tenant, `slots` in all), instead of waiting for a slot to be handed back.
        limit, share = self._limit(slots, self.active())
        if (not self.queued and self._may_start(tenant, slots, limit, share)) or (idle and self.busy < 2 * slots):
            return self._start(tenant, cost)
        loop = asyncio.get_running_loop()
        w = _Waiter(next(self._seq), tenant, CLASS_RANK.get(klass, 1), cost, loop.create_future())
        self.waiting.setdefault(tenant, deque()).append(w)
        self.pump(slots)  # slots may have grown since the last release (more workers)
        t0 = loop.time()
        try:
            await w.future
        except BaseException:
            if w.future.done() and not w.future.cancelled():  # granted as we were cancelled: give it back
                self.release(w.future.result())
            else:
                self._drop(w)
            raise
        grant = w.future.result()
        grant.waited_s = loop.time() - t0
        return grant

    def _drop(self, w: _Waiter) -> None:
        q = self.waiting.get(w.tenant)
        if q is not None and w in q:
            q.remove(w)
            if not q:
                del self.waiting[w.tenant]

    def release(self, grant: Grant, actual_in: int | None = None, actual_out: int | None = None,
                slots: int | None = None) -> None:
        """The request ended: correct its tenant's counter with the actual tokens (when known) and
        start the next waiting requests, `slots` (default: one per freed slot) at most running."""
        if grant.released:
            return
        grant.released = True
        t = grant.tenant
        self.running[t] = self.running.get(t, 1) - 1
        if self.running[t] <= 0:
            del self.running[t]
        if actual_in is not None and actual_out is not None:
            self.counters[t] = self.counters.get(t, 0.0) - grant.charged + W_IN * actual_in + W_OUT * actual_out
        self.pump(slots if slots is not None else self.busy + 1)

    def pump(self, slots: int) -> None:
        """Start waiting requests, by class then smallest counter, while fewer than `slots` run
        (`slots` <= 0: the capacity is unknown now, e.g. no fresh heartbeat: start them all), the
        reserve only for tenants under their share."""
        limit, share = self._limit(slots, self.active()) if self.waiting else (slots, 0.0)
        while slots <= 0 or self.busy < slots:
            # ties (a tenant just lifted to the smallest counter): the one with fewer running goes
            heads = [(q[0].rank, self.counters.get(t, 0.0), self.running.get(t, 0), q[0].seq, t)
                     for t, q in self.waiting.items() if q
                     and (slots <= 0 or self._may_start(t, slots, limit, share))]
            if not heads:
                return
            tenant = min(heads)[-1]
            q = self.waiting[tenant]
            w = q.popleft()
            if not q:
                del self.waiting[tenant]
            if w.future.done():  # cancelled meanwhile
                continue
            w.future.set_result(self._start(tenant, w.cost))


class Fairness:
    """The VTC queues of the deployments this gateway serves."""

    def __init__(self) -> None:
        self.queues: dict[str, FairQueue] = {}

    def queue(self, deployment: str) -> FairQueue:
        q = self.queues.get(deployment)
        if q is None:
            q = self.queues[deployment] = FairQueue()
        return q
