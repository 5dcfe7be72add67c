"""The worker service: one engine behind `<prefix>.v1.worker.<id>.{generate,cancel}`,
announced by WorkerUp, heartbeats (NATS event + Redis registry with TTL) and WorkerDown."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from polyserve.proto import (
    AdapterCommand,
    CancelRequest,
    Credit,
    GenerateRequest,
    Heartbeat,
    ReplayRequest,
    Withdraw,
    WorkerDown,
    WorkerUp,
)
from polyserve.shared.bus import decode, encode
from polyserve.shared.lifecycle import ServiceBase
from polyserve.worker.config import WorkerSettings, with_worker_id
from polyserve.worker.embed_handler import serve_embeddings
from polyserve.worker.engine import Engine
from polyserve.worker.engines import make_engine
from polyserve.worker.handlers import WorkerHandlers

logger = logging.getLogger(__name__)

DEFAULT_PROFILES = {"sim": "sim-llama2-70b-h100-tp4"}


def profile_ref(settings: WorkerSettings, engine: str) -> str:
    """The engine profile a dispatcher starts its performance fits from: the configured
    one, else the engine's shipped default ("" = none; the dispatcher then fits from scratch)."""
    if engine == "encoder":
        return settings.encoder_profile
    return settings.profile or DEFAULT_PROFILES.get(engine, "")


class WorkerService(ServiceBase):
    """Serves generate/cancel for its engine and reports its load every heartbeat."""

    name = "worker"
    settings: WorkerSettings

    def __init__(self, settings: WorkerSettings, *, engine: Engine | None = None, **kw: Any):
        settings = with_worker_id(settings)
        super().__init__(settings, **kw)
        self.worker_id = settings.worker_id
        self.engine: Engine | None = engine  # injected by tests; else built from settings at start
        self.handlers: WorkerHandlers | None = None
        self._heartbeat: asyncio.Task | None = None
        self._beating = False
        self._redis_ok = True
        self._registering: asyncio.Future | None = None  # the Redis registration of the last beat
        self._delivery: list = []  # the replay and credit subscriptions

    # ---------------------------------------------------------------- lifecycle hooks
    async def on_start(self) -> None:
        """Start the engine, serve generate/cancel, announce the worker, start heartbeats."""
        s = self.settings
        if self.engine is None:
            self.engine = make_engine(s)
        await self.engine.start()
        self.handlers = WorkerHandlers(self.engine, self.bus, self.tracer, self.worker_id,
                                       replay_chunks=s.replay_chunks, replay_linger_s=s.replay_linger_s,
                                       slow_reader_limit_s=s.slow_reader_limit_s, merge_ms=s.merge_ms)
        await self.bus.serve(self.subjects.generate(self.worker_id), GenerateRequest, self.handlers.generate)
        await self._serve_delivery()
        await self.bus.serve(self.subjects.cancel(self.worker_id), CancelRequest, self.handlers.cancel)
        await self.bus.serve(self.subjects.withdraw(self.worker_id), Withdraw, self.handlers.withdraw)
        self.embed_handler = await serve_embeddings(self)  # encoder engines: <p>.v1.worker.<id>.embed
        await self.bus.listen(self.subjects.adapters(s.deployment), AdapterCommand, self.handlers.adapter_command)
        await self.bus.sync()  # subscribed before anyone is told where to send
        await self.bus.publish(self.subjects.worker_event("up"), WorkerUp(
            worker_id=self.worker_id, deployment=s.deployment, model=s.model, engine=self.engine.name,
            gpu_id=s.gpu_id))
        await self.beat()  # visible to dispatchers as soon as it is ready
        self._beating = True
        self._heartbeat = self.background(self._heartbeat_loop(), "heartbeat")
        logger.info("worker %s serving %s (%s engine%s) for deployment %s", self.worker_id, s.model,
                    self.engine.name, ", simulated" if self.engine.simulated else "", s.deployment)

    async def on_drain(self, timeout: float) -> None:
        """Deregister, finish or cancel the streams, stop the engine, say WorkerDown."""
        self._beating = False
        if self._heartbeat is not None:
            # Bounded: a cancel that lands as a Redis call completes can be swallowed
            # (asyncio.wait_for on Python 3.11); the flag ends the loop regardless.
            self._heartbeat.cancel()
            await asyncio.wait({self._heartbeat}, timeout=2 * self.settings.heartbeat_interval_s + 1)
        # Intake is closed already: tell dispatchers at once rather than after a TTL.
        await self._deregister("draining")
        if self.handlers is not None:
            await self.handlers.drain(timeout)
        for sub in self._delivery:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self.engine is not None:
            try:
                await self.engine.stop()
            except Exception:
                logger.exception("worker %s: engine stop failed", self.worker_id)
        await self._deregister("stopped")

    async def _serve_delivery(self) -> None:
        """Replay (also the gateway's liveness probe) and credits. Subscribed outside the bus's
        intake on purpose: while draining, the streams still running need their credits and
        replays until they end; `on_drain` unsubscribes them last."""
        handlers, nc = self.handlers, self.bus.nc

        async def on_replay(m) -> None:
            try:
                reply = await handlers.replay(decode(m.data, ReplayRequest))
                if m.reply:
                    await nc.publish(m.reply, encode(reply))
            except Exception:  # noqa: BLE001 - a bad request: the gateway's request times out
                logger.exception("worker %s: replay request failed", self.worker_id)

        async def on_credit(m) -> None:
            try:
                await handlers.credit(decode(m.data, Credit))
            except Exception:  # noqa: BLE001
                logger.warning("worker %s: undecodable credit on %s", self.worker_id, m.subject)

        self._delivery = [await nc.subscribe(self.subjects.replay(self.worker_id), cb=on_replay),
                          await nc.subscribe(self.subjects.credit(self.worker_id), cb=on_credit)]

    # ---------------------------------------------------------------- heartbeats
    def heartbeat(self) -> Heartbeat:
        """This worker's current load, as dispatchers and the planner see it."""
        s = self.settings
        assert self.engine is not None
        load = self.engine.load()
        return Heartbeat(
            worker_id=self.worker_id, deployment=s.deployment, model=s.model, engine=self.engine.name,
            gpu_id=s.gpu_id, running=load.running, waiting=load.waiting, kv_used=load.kv_used,
            kv_capacity=load.kv_capacity, max_input_len=load.max_input_len, adapters=list(load.adapters),
            simulated=self.engine.simulated, ttl_s=s.heartbeat_ttl_s,
            generate_subject=self.subjects.generate(self.worker_id),
            cancel_subject=self.subjects.cancel(self.worker_id),
            max_batch=s.max_batch, kernel=getattr(self.engine, "lora_kernel", ""),
            profile=profile_ref(s, self.engine.name), max_adapters=getattr(self.engine, "max_adapters", 0) or 0,
            resumable=self.engine.resumable)

    async def beat(self, wait_registry: bool = True) -> None:
        """Publish one heartbeat and refresh the Redis registry; failures are logged, never raised.
        The loop does not wait for Redis (`wait_registry=False`): a slow or stopped Redis must not
        space the heartbeats out, or the gateway takes the gap for a NATS stall (it then places
        through the dispatcher, which may need Redis itself). One registration at a time."""
        hb = self.heartbeat()
        try:
            await self.bus.publish(self.subjects.worker_event("heartbeat"), hb)
        except Exception as exc:
            logger.warning("worker %s: cannot publish heartbeat: %s", self.worker_id, exc)
        if self._registering is not None and not self._registering.done():
            return  # the last one still waits on Redis; this beat's state goes with the next
        self._registering = asyncio.ensure_future(self._register(hb))
        if wait_registry:
            await self._registering

    async def _register(self, hb: Heartbeat) -> None:
        try:
            await asyncio.wait_for(self.state.put_worker(hb), self.settings.heartbeat_interval_s * 2)
        except Exception as exc:  # Redis briefly down: keep serving, retry next beat
            if self._redis_ok:
                logger.warning("worker %s: cannot register in Redis (%s: %s); retrying every %.1fs",
                               self.worker_id, type(exc).__name__, exc, self.settings.heartbeat_interval_s)
            self._redis_ok = False
            return
        if not self._redis_ok:
            logger.info("worker %s: Redis registry reachable again", self.worker_id)
            self._redis_ok = True

    async def _heartbeat_loop(self) -> None:
        while self._beating:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self._beating:
                return
            try:
                await self.beat(wait_registry=False)
            except Exception:  # e.g. an engine whose load() failed: report, keep beating
                logger.exception("worker %s: heartbeat failed", self.worker_id)

    async def _deregister(self, reason: str) -> None:
        s = self.settings
        if self._registering is not None:  # a late registration must not re-add it after the removal
            self._registering.cancel()
        try:
            await self.state.remove_worker(self.worker_id)
        except Exception as exc:
            logger.warning("worker %s: cannot remove itself from Redis: %s", self.worker_id, exc)
        try:
            await self.bus.publish(self.subjects.worker_event("down"), WorkerDown(
                worker_id=self.worker_id, reason=reason, deployment=s.deployment, gpu_id=s.gpu_id))
        except Exception as exc:
            logger.warning("worker %s: cannot publish WorkerDown: %s", self.worker_id, exc)
