"""The gateway service: the FastAPI app (app.py) served by uvicorn inside the common
lifecycle. The routes work on a `GatewayState` (context.py) that this service creates,
connects (bus, Redis, worker heartbeats) and drains."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn

from polyserve.gateway import limits
from polyserve.proto import Heartbeat, PrefixPlaced, WorkerDown
from polyserve.shared.lifecycle import ServiceBase

from . import observe
from .app import build_app
from .config import GatewaySettings
from .context import GatewayState

logger = logging.getLogger(__name__)

RETIRE_IDLE_S = 1.0  # a draining gateway with peers closes its idle connections after this quiet


def _http_impl() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, for uvicorn to listen on: every
    gateway process of `polyserve up --gateways N` binds the same port this way and the kernel
    hashes incoming connections over them. uvicorn has no option for it, hence the socket."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError("reuse_port: this platform has no SO_REUSEPORT; run one gateway per port")
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(info[4])
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


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
        self.gs = GatewayState(settings, self.subjects, self.tracer, self.ready)
        self.app = build_app(self.gs)
        self._server: _Server | None = None
        self._server_task: asyncio.Task | None = None

    @property
    def inflight(self) -> int:
        """Requests in flight now (streams included until they end)."""
        return self.gs.inflight

    @property
    def url(self) -> str:
        port = self.settings.port
        if self._server is not None and self._server.servers:
            port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.settings.host}:{port}"

    async def on_start(self) -> None:
        self.gs.bus, self.gs.state = self.bus, self.state
        await self.bus.listen(self.subjects.worker_event("heartbeat"), Heartbeat, self.gs.on_heartbeat)
        await self.bus.listen(self.subjects.worker_event("down"), WorkerDown, self.gs.on_down)
        await self.bus.listen(self.subjects.prefixes, PrefixPlaced, self.gs.on_prefix)  # other gateways' (prefixes.py)
        await observe.start(self.gs)  # dashboards' metrics: own request events, fleet events (observe.py)
        # The terminal events' stream, looked up before any traffic: once it has answered, an event
        # is kept until stored (never best effort) through an outage, one that starts at once too.
        await self.bus.outbox.prepare(self.subjects.prefix)
        with contextlib.suppress(Exception):
            await self.gs.refresh_deployments(force=True)
        # loop="none": uvicorn runs on the service's loop (uvloop when installed, shared/lifecycle.py);
        # httptools parses HTTP in C where installed (h11, pure Python, was ~8% of the gateway's CPU).
        # The edges (limits.py): connection cap (503 beyond it), keep-alive and slow-header timeouts,
        # on whichever HTTP implementation runs; and as many open files as the OS allows.
        limits.raise_nofile_limit()
        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port,
                                loop="none", log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=max(1, int(self.settings.drain_timeout_s)),
                                **limits.uvicorn_kwargs(self.settings, _http_impl()))
        self._server = _Server(config)
        sockets = [reuse_port_socket(self.settings.host, self.settings.port)] if self.settings.reuse_port else None
        self._server_task = asyncio.create_task(self._server.serve(sockets=sockets))
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()
                raise RuntimeError(f"gateway could not listen on {self.settings.host}:{self.settings.port}")
            await asyncio.sleep(0.02)
        logger.info("gateway listening on %s", self.url)

    async def on_drain(self, timeout: float) -> None:
        """Stop taking work, let in-flight requests finish, then stop uvicorn.

        With peers on the port (`reuse_port`: `polyserve up --gateways N`) the clients move to
        them without a transport error: the listening socket closes first (the kernel sends new
        connections to the peers); a request that still arrives on an open keep-alive
        connection is served, with `Connection: close` (app.Retire), so each connection retires
        after its next response and the client's pool opens a new one, to a peer; idle ones are
        closed only once no request has come for RETIRE_IDLE_S. Closing pooled connections at
        once was the race that cost httpx clients transport errors (docs/reliability.md).
        Alone on the port, the gateway refuses new requests at once (503 + Retry-After +
        `Connection: close`) and keeps listening, so clients get that answer, not a refused
        connection, until it exits and its supervisor restarts it."""
        deadline = time.monotonic() + timeout
        if self.settings.reuse_port and self._server is not None:
            await self._retire_connections(deadline)
        self.gs.draining = True
        while self.gs.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.gs.wait_cleanup(deadline - time.monotonic())
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server_task, timeout=max(1.0, deadline - time.monotonic()))

    async def _retire_connections(self, deadline: float) -> None:
        """Close the listener, keep serving the open connections (each closes after its next
        response) until none is left, or none is busy and none was used for RETIRE_IDLE_S."""
        retire = self.app.state.retire
        retire.since = retire.last_request = time.monotonic()
        for server in self._server.servers:
            server.close()  # new connections go to the other gateways on the port
        logger.info("gateway draining: listener closed, retiring %d open connection(s)",
                    len(self._server.server_state.connections))
        stop = deadline - min(2.0, (deadline - time.monotonic()) / 2)  # leave time for the rest of the drain
        while self._server.server_state.connections and time.monotonic() < stop:
            if not self.gs.inflight and time.monotonic() - retire.last_request >= RETIRE_IDLE_S:
                break
            await asyncio.sleep(0.05)
