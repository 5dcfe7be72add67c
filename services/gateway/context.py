"""`GatewayState`: everything the gateway's routes work with, in one object that the
service creates and hands to the route modules (they never reach into the service).

It holds the bus and the Redis state (filled in when the service starts), settings,
subjects, tracer and metrics, the in-flight count and draining flag, the deployment
cache (keeps serving when Redis is briefly down), the live workers of each deployment
(cached briefly) and a view of worker liveness (to fail streams of a dead worker fast).
Routes take it as a parameter of type `Gateway` (a FastAPI dependency)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from opentelemetry import trace

from polyserve.core.length_hint import LocalLengths
from polyserve.proto import AdapterSpec, Deployment, Heartbeat, PrefixPlaced, Subjects, WorkerDown
from polyserve.shared.bus import Bus
from polyserve.shared.state import State

from . import tenancy
from .config import GatewaySettings
from .errors import GatewayError
from .fairness import Fairness
from .keys import KeyStore
from .metrics import Metrics
from .predict_batch import PredictBatcher
from .prefixes import CHECKPOINTS, PrefixTable
from .ratelimit import Limiter
from .routing import LocalRouter

logger = logging.getLogger(__name__)
WORKERS_CACHE_S = 1.0  # how long the live workers of a deployment are taken from memory


class GatewayState:
    """The gateway's shared state; `bus` and `state` are set once the service is connected."""

    def __init__(self, settings: GatewaySettings, subjects: Subjects, tracer: trace.Tracer,
                 ready: asyncio.Event):
        self.settings = settings
        self.subjects = subjects
        self.tracer = tracer
        self.ready = ready  # the service's readiness (set once it listens)
        self.metrics = Metrics()
        self.bus: Bus = None  # type: ignore[assignment]  # set by the service on start
        self.state: State = None  # type: ignore[assignment]
        self.inflight = 0
        self.draining = False
        self.adapters: dict[str, AdapterSpec] = {}
        self._deployments: dict[str, Deployment] = {}
        self._deployments_at = 0.0
        self._deployments_lock = asyncio.Lock()
        self._heartbeats: dict[str, tuple[float, Heartbeat]] = {}  # worker -> (monotonic seen, last heartbeat)
        self.router = LocalRouter()  # each worker's load as this gateway sees it; load-only policies
        self.prefixes = PrefixTable(settings.prefix_table_blocks)  # prompt starts placed per worker (prefixes.py)
        self.lengths = LocalLengths()  # output lengths of completed requests: the local prediction
        self._probe: tuple[float, bool] = (0.0, True)  # (monotonic, NATS answered a ping)
        self._probe_lock = asyncio.Lock()
        self._reconnects = (0, 0.0)  # (NATS reconnect count seen, monotonic when it changed)
        self._last_heartbeat = 0.0  # monotonic arrival of the last heartbeat of any worker
        self._silence_end = 0.0  # monotonic end of the last time no worker was heard (a NATS stall)
        self._first_heard = 0.0  # monotonic arrival of the first heartbeat this gateway heard
        self._deps_seen: tuple[float, int, int] = (0.0, 0, 0)  # (monotonic, live dispatchers, workers) in Redis
        self._down: dict[str, tuple[float, str]] = {}  # worker -> (monotonic, reason)
        self._workers: dict[str, tuple[float, list[Heartbeat]]] = {}  # deployment -> (monotonic, live)
        self._workers_lock = asyncio.Lock()
        self._cleanup: set[asyncio.Future] = set()
        self.taps: list[Callable[[Any], None]] = []  # see every event `emit` publishes (observe.py's metrics)
        self.fairness = Fairness()  # VTC queues per deployment (fairness.py)
        self._keystore: KeyStore | None = None
        self._limiter: Limiter | None = None
        self._predictions: PredictBatcher | None = None

    # ---------------------------------------------------------------- client keys (issue 14)
    @property
    def keystore(self) -> KeyStore:
        """Client API keys in Redis (keys.py), made on first use (Redis is connected by then)."""
        if self._keystore is None:
            self._keystore = KeyStore(self.state.r, self.settings.prefix, self.settings.key_cache_s)
        return self._keystore

    @property
    def limiter(self) -> Limiter:
        """The per-key RPM/TPM token buckets in Redis (ratelimit.py)."""
        if self._limiter is None:
            self._limiter = Limiter(self.state.r, self.settings.prefix)
        return self._limiter

    @property
    def predictions(self) -> PredictBatcher:
        """Predictions nothing waits for, asked in batches (predict_batch.py)."""
        if self._predictions is None:
            self._predictions = PredictBatcher(self, self.settings.predict_batch_ms / 1e3)
        return self._predictions

    # ---------------------------------------------------------------- helpers
    def spawn(self, coro) -> None:
        """Run clean-up work that must finish even if the caller is being cancelled."""
        self.track(asyncio.ensure_future(coro))

    def track(self, fut: asyncio.Future) -> None:
        """`wait_cleanup` waits for `fut` too (work its done-callbacks finish, e.g. an event)."""
        self._cleanup.add(fut)
        fut.add_done_callback(self._cleanup.discard)

    async def wait_cleanup(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) for the clean-up work started with `spawn`."""
        if self._cleanup:
            await asyncio.wait(set(self._cleanup), timeout=max(0.1, timeout))

    async def event(self, kind: str, event, counted: bool = False) -> None:
        """`emit`, for the routes (a coroutine: tests replace it to watch events)."""
        self.emit(kind, event, counted)

    def emit(self, kind: str, event, counted: bool = False) -> None:
        """Publish a lifecycle event, best effort: a request goes on when it cannot be sent.
        Coalesced (Bus.publish_soon): the ~5 events of a request, and those of concurrent
        requests, share socket writes instead of one each; in order, at most 2 ms later.
        Synchronous (publish_soon only queues), so a done-callback can publish without a task.

        Also the usage hook of client keys: a `completed` event carries the tokens the worker
        counted, added to the ticket of the request being served (tenancy.py), which settles
        its key's TPM reservation and usage counters when the request ends (access.py)."""
        for tap in self.taps:
            try:
                tap(event)
            except Exception:  # noqa: BLE001 - metrics never stop an event
                logger.debug("an event tap failed on %s", kind, exc_info=True)
        if kind == "completed" and not counted:
            self.count_usage(event)
        try:
            self.bus.publish_soon(self.subjects.event(kind), event)
        except Exception:  # noqa: BLE001 - events are best effort; the request goes on
            logger.warning("could not publish %s for %s", kind, getattr(event, "request_id", "?"))

    @staticmethod
    def count_usage(event) -> None:
        """Add a `completed` event's tokens to the client key's ticket of the request being served
        (`event(..., counted=True)` when this was done already)."""
        ticket = tenancy.current()
        if ticket is not None:
            ticket.used(getattr(event, "input_tokens", 0), getattr(event, "output_tokens", 0))

    def ready_to_serve(self) -> bool:
        return self.ready.is_set() and not self.draining and self.bus is not None and self.bus.nc.is_connected

    async def not_ready(self) -> str:
        """Why the gateway cannot serve now ('' when it can): starting or draining, NATS
        disconnected, Redis down with no deployment cached, or neither a live dispatcher
        (the Redis service registry) nor a live worker (heartbeats, or the Redis registry)."""
        if not self.ready.is_set():
            return "starting"
        if self.draining:
            return "draining: the gateway is shutting down"
        if self.bus is None or not self.bus.nc.is_connected:
            return "NATS disconnected: the gateway cannot reach predictor, dispatcher or workers (reconnecting)"
        redis_ok = await self._read_registry()
        if not redis_ok and not self._deployments:
            return "Redis unavailable and no deployment cached: no request can be resolved"
        if not self._deps_seen[1] and not self._deps_seen[2] and not self.fresh_heartbeats():
            return "no live dispatcher and no live worker: nothing can place or run a request"
        return ""

    async def _read_registry(self) -> bool:
        """Refresh (at most once a second) the live dispatchers and workers from Redis; False
        when Redis did not answer (the last counts stay)."""
        if time.monotonic() - self._deps_seen[0] < 1.0:
            return True
        try:
            services = await asyncio.wait_for(self.state.live_services(), timeout=1.0)
            workers = await asyncio.wait_for(self.state.live_workers(), timeout=1.0)
        except Exception:  # noqa: BLE001 - any Redis failure means "unavailable" here
            return False
        dispatchers = sum(1 for x in services if x.service == "dispatcher" and x.state == "ready")
        self._deps_seen = (time.monotonic(), dispatchers, len(workers))
        return True

    # ---------------------------------------------------------------- worker liveness
    async def on_heartbeat(self, hb: Heartbeat) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat > hb.ttl_s / 2:  # nobody was heard: NATS (or this gateway) stalled
            self._silence_end = now
            self._first_heard = self._first_heard or now  # the first heartbeat ends no stall
        self._last_heartbeat = now
        self._heartbeats[hb.worker_id] = (now, hb)
        self._down.pop(hb.worker_id, None)
        self.router.on_heartbeat(hb)

    def fleet_steady(self, ttl: float) -> bool:
        """Whether workers are heard as usual: some heartbeat within `ttl`/2 and none of the
        fleet-wide silences (a NATS stall) ended within `ttl`. While they are not, the gateway
        leaves placement to the dispatcher path (routing.py): a stall's aftermath (clients
        reconnecting, nats-server working through the backlog) is no time to act on heartbeats."""
        now = time.monotonic()
        settled = self._silence_end == self._first_heard or now - self._silence_end > ttl
        return now - self._last_heartbeat <= ttl / 2 and settled

    def fresh_heartbeats(self, dep_id: str | None = None) -> list[Heartbeat]:
        """The last heartbeat of each worker (of `dep_id`) heard from within its TTL."""
        now = time.monotonic()
        return [hb for seen, hb in self._heartbeats.values()
                if now - seen <= hb.ttl_s and (dep_id is None or hb.deployment == dep_id)]

    def max_input_len(self, dep_id: str) -> int:
        """The longest input (tokens) a live worker of `dep_id` takes; 0 when unknown or unlimited."""
        lens = [hb.max_input_len for hb in self.fresh_heartbeats(dep_id)]
        return 0 if not lens or min(lens) <= 0 else max(lens)

    async def bus_healthy(self, grace: float) -> bool:
        """Whether NATS works now, so a missing heartbeat is the worker's fault: connected, not
        reconnected within `grace` seconds (heartbeats resume after a reconnect), and answering
        a ping (a stopped nats-server does not). One probe at a time (Bus.ping), cached for 0.5 s."""
        nc = self.bus.nc if self.bus is not None else None
        if nc is None or not nc.is_connected:
            return False
        now = time.monotonic()
        count = nc.stats.get("reconnects", 0)
        if count != self._reconnects[0]:
            self._reconnects = (count, now)
        if count and now - self._reconnects[1] < grace:
            return False
        async with self._probe_lock:
            if time.monotonic() - self._probe[0] > 0.5:
                answered = await self.bus.ping(timeout=1.0)  # never nc.flush(timeout): see Bus.ping
                self._probe = (time.monotonic(), answered)
            return self._probe[1]

    async def worker_lost(self, worker_id: str, since: float) -> str:
        """`worker_gone`, but a heartbeat gap counts only while NATS itself is healthy (a NATS
        blip delays every heartbeat and must not fail the streams of healthy workers)."""
        gone = self.worker_gone(worker_id, since)
        if not gone or worker_id in self._down:
            return gone
        hb = self._heartbeats.get(worker_id)
        ttl = hb[1].ttl_s if hb else 3.0
        now = time.monotonic()
        # Every worker silent (a NATS pause stalls them all), or the silence ended less than a TTL
        # ago (heartbeats queued behind the backlog arrive one by one): not this worker's fault.
        if hb and (now - self._last_heartbeat > ttl / 2 or now - max(hb[0], self._silence_end) <= ttl):
            return ""
        return gone if await self.bus_healthy(grace=ttl + 1.0) else ""

    def placed_prefix(self, deployment: str, hashes: tuple[int, ...], worker_id: str) -> None:
        """A prompt with these starts (prefixes.blocks) runs on `worker_id`: in this gateway's table
        and, best effort, every other gateway's (`PrefixPlaced`)."""
        if not hashes:
            return
        self.prefixes.record(hashes, worker_id)
        try:
            self.bus.publish_soon(self.subjects.prefixes, PrefixPlaced(
                deployment=deployment, worker_id=worker_id, gateway=self.settings.instance, hashes=list(hashes)))
        except Exception:  # noqa: BLE001 - a hint: the request goes on without it
            logger.debug("could not share the prompt starts of a placement on %s", worker_id, exc_info=True)

    async def on_prefix(self, msg: PrefixPlaced) -> None:
        if msg.gateway != self.settings.instance:  # (its own: recorded when it placed)
            self.prefixes.record(tuple(msg.hashes[:len(CHECKPOINTS)]), msg.worker_id)  # (at most one prompt's)

    async def on_down(self, ev: WorkerDown) -> None:
        self._down[ev.worker_id] = (time.monotonic(), ev.reason)
        self._heartbeats.pop(ev.worker_id, None)
        self.router.forget(ev.worker_id)
        self.prefixes.forget(ev.worker_id)

    def worker_gone(self, worker_id: str, since: float) -> str:
        """Why `worker_id` is known dead since `since` (monotonic), or '' if it is not."""
        down = self._down.get(worker_id)
        if down and down[0] >= since - 1.0:
            return down[1]
        seen = self._heartbeats.get(worker_id)
        if seen and time.monotonic() - seen[0] > seen[1].ttl_s:
            return f"no heartbeat for {time.monotonic() - seen[0]:.1f}s (ttl {seen[1].ttl_s:.1f}s)"
        return ""

    async def live_workers(self, dep_id: str) -> list[Heartbeat]:
        """Live workers of a deployment, from the Redis registry, cached for WORKERS_CACHE_S;
        on a Redis error the last copy answers, else GatewayError 503."""
        hit = self._workers.get(dep_id)
        if hit and time.monotonic() - hit[0] < WORKERS_CACHE_S:
            return hit[1]
        async with self._workers_lock:
            hit = self._workers.get(dep_id)
            if hit and time.monotonic() - hit[0] < WORKERS_CACHE_S:
                return hit[1]
            try:
                live = await asyncio.wait_for(self.state.live_workers(), timeout=2.0)
            except Exception as exc:
                if hit:
                    return hit[1]
                raise GatewayError(503, f"cluster state (Redis) unavailable: {exc}", retry_after=1) from exc
            ws = [hb for hb in live if hb.deployment == dep_id]
            self._workers[dep_id] = (time.monotonic(), ws)
            return ws

    # ---------------------------------------------------------------- deployments
    async def refresh_deployments(self, force: bool = False) -> dict[str, Deployment]:
        """Deployments from Redis, cached; on a Redis error the cached copy answers."""
        if not force and time.monotonic() - self._deployments_at < self.settings.deployment_cache_s:
            return self._deployments
        async with self._deployments_lock:
            if not force and time.monotonic() - self._deployments_at < self.settings.deployment_cache_s:
                return self._deployments
            try:
                deps = await asyncio.wait_for(self.state.list_deployments(), timeout=2.0)
                adapters = await asyncio.wait_for(self.state.list_adapters(), timeout=2.0)
            except Exception as exc:
                if not self._deployments:
                    raise
                logger.warning("Redis unavailable (%s); serving %d cached deployments", exc,
                               len(self._deployments))
                self._deployments_at = time.monotonic()
                return self._deployments
            if not deps and self._deployments and not force:
                # Redis answered but lists no deployment: a restart without its data or a FLUSHALL,
                # not a delete (a DELETE through this gateway refreshes with force=True). Keep the
                # cache until the desired state is back (the planner re-applies --config).
                logger.warning("Redis lists no deployment; keeping %d cached deployment(s)", len(self._deployments))
                self._deployments_at = time.monotonic()
                return self._deployments
            self._deployments = {d.id: d for d in deps}
            self.adapters = {a.name: a for a in adapters}
            self._deployments_at = time.monotonic()
            return self._deployments

    async def find_deployment(self, model: str) -> tuple[Deployment | None, AdapterSpec | None]:
        """What a request's `model` names: a deployment (by id, else model name), or a
        registered LoRA adapter, which resolves to its base deployment (as in vLLM)."""
        deps = await self.refresh_deployments()
        if model in deps:
            return deps[model], None
        for dep in deps.values():
            if dep.model == model:
                return dep, None
        spec = self.adapters.get(model)
        if spec is not None:
            return deps.get(spec.deployment), spec
        return None, None


async def gateway_state(request: Request) -> GatewayState:
    """FastAPI dependency: the GatewayState of the app that serves the request. `async` on
    purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread hop and GIL
    hand-offs per request (~10% of the gateway's py-spy samples; docs/benchmarks/overhead.md)."""
    return request.app.state.gateway


Gateway = Annotated[GatewayState, Depends(gateway_state)]
"""A route parameter of this type receives the gateway's state."""
