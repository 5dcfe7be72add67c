"""The dispatcher's in-memory state: live workers (heartbeats, TTLs, tombstones), the
outstanding placements it has made, and the deployment cache read from Redis."""
from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from polyserve.proto import Deployment, Heartbeat, WorkerDown
from polyserve.shared.bus import BusError
from polyserve.shared.state import State

logger = logging.getLogger(__name__)
Clock = Callable[[], float]

MAX_SILENCE_S = 30.0  # a silence of every worker longer than this is not taken for a NATS stall
TOMBSTONE_S = 60.0  # how long a WorkerDown keeps older, late heartbeats from reviving a worker


@dataclass
class _Live:
    hb: Heartbeat
    expires: float  # monotonic


class WorkerRegistry:
    """Workers heard from recently: added by heartbeats, expired after their `ttl_s`,
    removed at once by WorkerDown."""

    def __init__(self, clock: Clock = time.monotonic, wall: Clock = time.time):
        self.clock = clock
        self.wall = wall
        self._workers: dict[str, _Live] = {}
        self._down: dict[str, tuple[float, float]] = {}  # worker_id -> (down event ts, forget at)
        self._expiries: list[tuple[float, str]] = []  # heap; stale entries dropped lazily
        self._heard = 0.0  # monotonic arrival of the last live heartbeat of any worker
        self._ttl_floor = math.inf  # the smallest TTL any heartbeat carried: a lower bound of the live ones'

    def heartbeat(self, hb: Heartbeat, *, seeded: bool = False) -> bool:
        """Record a heartbeat; False when it predates a WorkerDown of that worker.

        A live heartbeat counts from its arrival (immune to clock skew between
        hosts); one seeded from Redis counts from its own timestamp.
        """
        down = self._down.get(hb.worker_id)
        if down is not None:
            if hb.ts <= down[0]:
                return False
            del self._down[hb.worker_id]
        self._ttl_floor = min(self._ttl_floor, hb.ttl_s)
        if not seeded:
            self._after_silence(hb.ttl_s)
        ttl = hb.ttl_s if not seeded else max(0.0, hb.ts + hb.ttl_s - self.wall())
        live = self._workers[hb.worker_id] = _Live(hb, self.clock() + ttl)
        heapq.heappush(self._expiries, (live.expires, hb.worker_id))
        if len(self._expiries) > 4 * len(self._workers) + 64:  # bound the stale entries
            self._expiries = [(w.expires, wid) for wid, w in self._workers.items()]
            heapq.heapify(self._expiries)
        return True

    def _after_silence(self, ttl: float) -> None:
        """Every worker fell silent at once (`silent`): NATS stalled (issue 13, nats-pause), the
        workers did not all die. Those it silenced get a TTL from now for their heartbeats,
        queued behind the stall's backlog, to come back, instead of being dropped as dead."""
        now = self.clock()
        if self.silent(now):
            for wid, w in self._workers.items():
                if w.expires < now + w.hb.ttl_s:
                    w.expires = now + w.hb.ttl_s
                    heapq.heappush(self._expiries, (w.expires, wid))
        self._heard = now

    def silent(self, now: float | None = None) -> bool:
        """Two or more workers heard before, and none for half a TTL (at most MAX_SILENCE_S ago):
        a NATS stall. A lone worker falling silent is that worker's own fault."""
        now = self.clock() if now is None else now
        gap = now - self._heard
        # Every heartbeat asks (`_after_silence`): while they flow the gap is far under any TTL, and
        # the bound answers without the scan of every worker (at 1,200 workers heartbeating each
        # second, the scan per heartbeat was 1.4 M steps a second of the dispatcher's one loop).
        if len(self._workers) < 2 or self._heard <= 0 or not self._ttl_floor / 2 < gap <= MAX_SILENCE_S:
            return False
        ttl = min((w.hb.ttl_s for w in self._workers.values()), default=0.0)
        return ttl / 2 < gap

    def any_expired(self) -> bool:
        """Whether some worker's TTL has run out and the sweep has not removed it yet."""
        h, now = self._expiries, self.clock()
        while h:
            exp, wid = h[0]
            w = self._workers.get(wid)
            if w is None or w.expires != exp:
                heapq.heappop(h)  # a newer heartbeat, or gone
                continue
            return exp <= now
        return False

    def get(self, worker_id: str) -> Heartbeat | None:
        """The worker's last heartbeat while it is in memory (expired or not)."""
        w = self._workers.get(worker_id)
        return w.hb if w is not None else None

    def of(self, deployment: str) -> list[Heartbeat]:
        """Last heartbeats of the deployment's workers in memory, expired or not."""
        return [w.hb for w in self._workers.values() if w.hb.deployment == deployment]

    def down(self, ev: WorkerDown) -> bool:
        """Remove a worker at once; True when it was known."""
        self._down[ev.worker_id] = (ev.ts, self.clock() + TOMBSTONE_S)
        return self._workers.pop(ev.worker_id, None) is not None

    def live(self, deployment: str) -> list[Heartbeat]:
        """Last heartbeats of the deployment's workers whose TTL has not run out."""
        now = self.clock()
        stalled = self.silent(now)  # NATS stalled: the last known fleet is the best guess (a dead one: 503 at once)
        return [w.hb for w in self._workers.values() if w.hb.deployment == deployment and (stalled or w.expires > now)]

    def live_one(self, worker_id: str, deployment: str) -> Heartbeat | None:
        """The worker's last heartbeat when it is a live worker of `deployment` (as `live`), else None."""
        w = self._workers.get(worker_id)
        if w is None or w.hb.deployment != deployment:
            return None
        now = self.clock()
        return w.hb if w.expires > now or self.silent(now) else None

    def known(self, deployment: str) -> int:
        """Workers of the deployment still in memory, expired or not."""
        return sum(1 for w in self._workers.values() if w.hb.deployment == deployment)

    def sweep(self) -> list[str]:
        """Forget expired workers and old tombstones; return the expired worker ids."""
        now = self.clock()
        # during a silence of every worker (a NATS stall) keep them: _after_silence renews them
        gone = [] if self.silent() else [wid for wid, w in self._workers.items() if w.expires <= now]
        for wid in gone:
            del self._workers[wid]
        for wid in [wid for wid, (_, until) in self._down.items() if until <= now]:
            del self._down[wid]
        return gone

    def __len__(self) -> int:
        return len(self._workers)


class Outstanding:
    """request_id -> worker of this dispatcher's placements, until a completed/failed
    event; bounded (`max_tracked`) and expiring (`ttl_s`) so leaks cannot grow."""

    def __init__(self, max_tracked: int, ttl_s: float, clock: Clock = time.monotonic):
        self.max_tracked = max_tracked
        self.ttl_s = ttl_s
        self.clock = clock
        self._placed: OrderedDict[str, tuple[str, float]] = OrderedDict()  # oldest first
        self._per_worker: dict[str, int] = {}
        self.expired = 0
        self.evicted = 0
        self.on_change: Callable[[str], None] | None = None  # told of each worker whose count changed

    def place(self, request_id: str, worker_id: str) -> None:
        """Count a placement (a retry of the same request moves it to the new worker)."""
        self.finish(request_id)
        self._placed[request_id] = (worker_id, self.clock() + self.ttl_s)
        self._per_worker[worker_id] = self._per_worker.get(worker_id, 0) + 1
        if self.on_change is not None:
            self.on_change(worker_id)
        while len(self._placed) > self.max_tracked:
            self._drop_oldest()
            self.evicted += 1

    def finish(self, request_id: str) -> str | None:
        """Stop counting a request; its worker, or None when it was not tracked."""
        entry = self._placed.pop(request_id, None)
        if entry is None:
            return None
        self._dec(entry[0])
        return entry[0]

    def forget_worker(self, worker_id: str) -> int:
        """Drop every placement on a worker that is gone; how many were dropped."""
        ids = [rid for rid, (wid, _) in self._placed.items() if wid == worker_id]
        for rid in ids:
            self.finish(rid)
        return len(ids)

    def expire(self) -> int:
        """Drop placements older than the TTL; how many were dropped."""
        now, n = self.clock(), 0
        while self._placed and next(iter(self._placed.values()))[1] <= now:
            self._drop_oldest()
            n += 1
        self.expired += n
        return n

    def count(self, worker_id: str) -> int:
        return self._per_worker.get(worker_id, 0)

    def worker_of(self, request_id: str) -> str | None:
        """The worker a tracked request is counted on (None when it is not tracked)."""
        entry = self._placed.get(request_id)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._placed)

    def _drop_oldest(self) -> None:
        _, (wid, _) = self._placed.popitem(last=False)
        self._dec(wid)

    def _dec(self, worker_id: str) -> None:
        n = self._per_worker.get(worker_id, 0) - 1
        if n > 0:
            self._per_worker[worker_id] = n
        else:
            self._per_worker.pop(worker_id, None)
        if self.on_change is not None:
            self.on_change(worker_id)


class DeploymentCache:
    """Deployments read from Redis, each reused for `ttl_s`; when Redis fails the
    cached copy keeps serving (stale) and Redis is left alone for `retry_s`."""

    MAX_ENTRIES = 4096

    def __init__(self, state: State, *, ttl_s: float, timeout_s: float, retry_s: float,
                 clock: Clock = time.monotonic):
        self.state = state
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self._cache: OrderedDict[str, tuple[Deployment, float]] = OrderedDict()
        self._down_until = 0.0
        self.redis_errors = 0

    def cached(self, dep_id: str) -> Deployment | None:
        """The cached copy, however old (no Redis call)."""
        entry = self._cache.get(dep_id)
        return entry[0] if entry is not None else None

    async def get(self, dep_id: str) -> Deployment | None:
        """The deployment, or None when Redis says it does not exist.

        Raises BusError(503) only when Redis is unavailable and the deployment
        was never cached.
        """
        now = self.clock()
        cached = self._cache.get(dep_id)
        if cached is not None and now - cached[1] < self.ttl_s:
            return cached[0]
        if now >= self._down_until:
            try:
                dep = await asyncio.wait_for(self.state.get_deployment(dep_id), self.timeout_s)
            except Exception as exc:  # timeout, connection refused: serve from the cache
                self.redis_errors += 1
                self._down_until = self.clock() + self.retry_s
                logger.warning("dispatcher: cannot read deployment %r from Redis (%s: %s)%s", dep_id,
                               type(exc).__name__, exc, "; using the cached copy" if cached else "")
            else:
                if dep is None:
                    self._cache.pop(dep_id, None)
                    return None
                self._cache[dep_id] = (dep, self.clock())
                self._cache.move_to_end(dep_id)
                while len(self._cache) > self.MAX_ENTRIES:
                    self._cache.popitem(last=False)
                return dep
        if cached is not None:
            return cached[0]
        raise BusError(503, f"deployment registry (Redis) unavailable and deployment {dep_id!r} "
                            "is not cached; retry shortly")
