"""The gateway service: FastAPI app served by uvicorn inside the common lifecycle,
with a deployment cache (keeps serving when Redis is briefly down) and a view of
worker liveness (to fail streams of a dead worker fast)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import uvicorn

from polyserve.proto import AdapterSpec, Deployment, Heartbeat, WorkerDown
from polyserve.shared.lifecycle import ServiceBase

from .app import build_app
from .config import GatewaySettings
from .metrics import Metrics

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: our lifecycle owns signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class GatewayService(ServiceBase):
    name = "gateway"
    settings: GatewaySettings

    def __init__(self, settings: GatewaySettings, **kw):
        super().__init__(settings, **kw)
        self.metrics = Metrics()
        self.inflight = 0
        self.draining = False
        self._deployments: dict[str, Deployment] = {}
        self.adapters: dict[str, AdapterSpec] = {}
        self._deployments_at = 0.0
        self._deployments_lock = asyncio.Lock()
        self._heartbeats: dict[str, tuple[float, float]] = {}  # worker -> (monotonic seen, ttl)
        self._down: dict[str, tuple[float, str]] = {}  # worker -> (monotonic, reason)
        self.app = build_app(self)
        self._server: _Server | None = None
        self._server_task: asyncio.Task | None = None
        self._cleanup: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        """Run clean-up work that must finish even if the caller is being cancelled."""
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    @property
    def url(self) -> str:
        port = self.settings.port
        if self._server is not None and self._server.servers:
            port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.settings.host}:{port}"

    async def on_start(self) -> None:
        await self.bus.listen(self.subjects.worker_event("heartbeat"), Heartbeat, self._on_heartbeat)
        await self.bus.listen(self.subjects.worker_event("down"), WorkerDown, self._on_down)
        with contextlib.suppress(Exception):
            await self.refresh_deployments(force=True)
        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port,
                                log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=max(1, int(self.settings.drain_timeout_s)))
        self._server = _Server(config)
        self._server_task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()
                raise RuntimeError(f"gateway could not listen on {self.settings.host}:{self.settings.port}")
            await asyncio.sleep(0.02)
        logger.info("gateway listening on %s", self.url)

    async def on_drain(self, timeout: float) -> None:
        """Refuse new requests, let in-flight ones finish, then stop uvicorn."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._cleanup:
            await asyncio.wait(set(self._cleanup), timeout=max(0.1, deadline - time.monotonic()))
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server_task, timeout=max(1.0, deadline - time.monotonic()))

    # ---------------------------------------------------------------- worker liveness
    async def _on_heartbeat(self, hb: Heartbeat) -> None:
        self._heartbeats[hb.worker_id] = (time.monotonic(), hb.ttl_s)
        self._down.pop(hb.worker_id, None)

    async def _on_down(self, ev: WorkerDown) -> None:
        self._down[ev.worker_id] = (time.monotonic(), ev.reason)
        self._heartbeats.pop(ev.worker_id, None)

    def worker_gone(self, worker_id: str, since: float) -> str:
        """Why `worker_id` is known dead since `since` (monotonic), or '' if it is not."""
        down = self._down.get(worker_id)
        if down and down[0] >= since - 1.0:
            return down[1]
        seen = self._heartbeats.get(worker_id)
        if seen and time.monotonic() - seen[0] > seen[1]:
            return f"no heartbeat for {time.monotonic() - seen[0]:.1f}s (ttl {seen[1]:.1f}s)"
        return ""

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
