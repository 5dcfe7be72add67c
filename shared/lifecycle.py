"""Service lifecycle: startup -> serve until stop -> shutdown (DESIGN.md, rule 2).

Signals only set the stop event. Shutdown stops intake, drains in-flight work
within `drain_timeout_s`, then drains NATS, closes Redis and flushes traces.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

from polyserve.proto import Keys, ServiceState, Subjects
from polyserve.shared import settings as settings_mod
from polyserve.shared.bus import Bus
from polyserve.shared.state import State, connect
from polyserve.shared.telemetry import make_tracer, setup_logging, shutdown_tracer

logger = logging.getLogger(__name__)


class ServiceBase:
    """Common skeleton; subclasses implement on_start / on_drain and set `name`."""

    name = "service"

    def __init__(self, settings: settings_mod.CommonSettings, *,
                 span_exporter: SpanExporter | None = None):
        self.settings = settings
        self.subjects = Subjects(settings.prefix)
        self.keys = Keys(settings.prefix)
        self.tracer, self._provider = make_tracer(self.name, settings.otlp_endpoint, span_exporter)
        self.stop_event = asyncio.Event()
        self.ready = asyncio.Event()
        self.bus: Bus = None  # type: ignore[assignment]  # set in start()
        self.state: State = None  # type: ignore[assignment]
        self._background: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- hooks
    def tune_process(self) -> None:
        """Process-wide settings (e.g. the dispatcher's garbage-collection thresholds) that a
        service applies when it runs as its own process (`run_main`), never inside a test's."""

    async def on_start(self) -> None:
        """Subscribe handlers and start loops. Called with bus and state connected."""

    async def on_drain(self, timeout: float) -> None:
        """Finish or cancel in-flight work of the service itself within `timeout`."""

    # ---------------------------------------------------------------- helpers
    def background(self, coro: Any, name: str) -> asyncio.Task:
        """Run a loop until shutdown; it is cancelled at shutdown."""
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _state_msg(self, state: str) -> ServiceState:
        return ServiceState(service=self.name, instance=self.settings.instance, state=state, pid=os.getpid())

    async def _presence_loop(self) -> None:
        ttl = self.settings.service_ttl_s
        while not self.stop_event.is_set():
            try:
                await self.state.put_service(self._state_msg("ready"), ttl)
            except Exception as exc:  # Redis briefly down: keep serving, retry
                logger.warning("%s: cannot refresh presence in Redis: %s", self.name, exc)
            try:  # wake at once on stop, even if a cancel was swallowed by a client library
                await asyncio.wait_for(self.stop_event.wait(), ttl / 3)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Connect, subscribe, flush, then announce readiness."""
        self.bus = await Bus.connect(self.settings.nats_url, self.tracer, self.name)
        self.state = State(connect(self.settings.redis_url), self.keys)
        await self.on_start()
        await self.bus.sync()
        await self.state.put_service(self._state_msg("ready"), self.settings.service_ttl_s)
        await self.bus.publish(self.subjects.service_event("ready"), self._state_msg("ready"))
        self.background(self._presence_loop(), "presence")
        self.ready.set()
        logger.info("%s %s ready", self.name, self.settings.instance)

    def request_stop(self) -> None:
        self.stop_event.set()

    async def stop(self) -> None:
        """Stop intake, drain, disconnect. Never raises."""
        timeout = self.settings.drain_timeout_s
        logger.info("%s %s draining (timeout %.1fs)", self.name, self.settings.instance, timeout)
        try:
            if self.bus is not None:
                await self.bus.publish(self.subjects.service_event("draining"), self._state_msg("draining"))
                await self.bus.stop_intake()
            await self.on_drain(timeout)
            if self.bus is not None:
                await self.bus.wait_idle(timeout)
        except Exception:
            logger.exception("%s: error while draining", self.name)
        self.stop_event.set()
        for task in list(self._background):
            task.cancel()
        if self._background:
            _, stuck = await asyncio.wait(set(self._background), timeout=timeout)
            if stuck:
                logger.warning("%s: %d background tasks ignored cancellation", self.name, len(stuck))
        try:
            if self.state is not None:
                await self.state.remove_service(self.name, self.settings.instance)
            if self.bus is not None:
                await self.bus.publish(self.subjects.service_event("stopped"), self._state_msg("stopped"))
        except Exception as exc:
            logger.warning("%s: could not deregister: %s", self.name, exc)
        if self.bus is not None:
            await self.bus.close()
        if self.state is not None:
            try:
                await self.state.close()
            except Exception:
                pass
        shutdown_tracer(self._provider)
        logger.info("%s %s stopped", self.name, self.settings.instance)

    async def run(self) -> None:
        """start -> wait for the stop event -> stop."""
        try:
            await self.start()
            await self.stop_event.wait()
        finally:
            await self.stop()


LOOP_ENV = "POLYSERVE_EVENT_LOOP"


def loop_factory(choice: str | None = None):
    """The event loop factory every service runs on: env POLYSERVE_EVENT_LOOP = `auto` (default:
    uvloop when it is installed, else asyncio's), `uvloop` (the same, with a warning when it is
    missing) or `asyncio`. uvloop's C loop roughly halves the per-message cost of the bus and of
    HTTP (docs/benchmarks/overhead.md); asyncio's loop is the safe fallback, same behaviour."""
    choice = (choice if choice is not None else os.environ.get(LOOP_ENV, "auto")).strip().lower() or "auto"
    if choice not in ("auto", "uvloop", "asyncio"):
        logger.warning("%s=%s is not auto, uvloop or asyncio; using auto", LOOP_ENV, choice)
        choice = "auto"
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            logger.warning("%s=uvloop but uvloop is not installed; using asyncio's loop", LOOP_ENV)
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_loop(coro, choice: str | None = None):
    """`asyncio.run(coro)` on the loop `loop_factory` picks (Python 3.10, without
    asyncio.Runner: asyncio's own loop)."""
    if not hasattr(asyncio, "Runner"):
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(coro)


FATAL = "stopped with an error: "  # a service's last log line when it cannot start (`polyserve up` reads it)


def run_main(service_cls: type[ServiceBase], settings_cls: type[settings_mod.CommonSettings],
             argv: list[str] | None = None) -> int:
    """Entry point of `python -m polyserve.<svc>`: settings, logging, signals, run."""
    name = service_cls.name
    try:
        cfg = settings_mod.load(settings_cls, name, sys.argv[1:] if argv is None else argv)
    except settings_mod.SettingsError as exc:
        # logging is set up from these settings, so not yet: the one line goes to stderr directly
        sys.stderr.write(f"polyserve-{name} {FATAL}{exc}\n")
        return 2
    setup_logging(cfg.log_level)

    async def main() -> None:
        service = service_cls(cfg)
        service.tune_process()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        await service.run()

    try:
        run_loop(main())
    except Exception as exc:  # noqa: BLE001 - the one place a service reports a fatal start error
        logger.error("%s %s%s: %s", name, FATAL, type(exc).__name__, exc)
        return 1
    return 0
