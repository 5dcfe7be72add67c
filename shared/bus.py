"""The NATS bus: typed request/reply with error headers, events, streamed replies,
and W3C trace-context propagation in NATS headers on every hop.

Errors cross the bus as a reply carrying the `Nats-Service-Error-Code` and
`Nats-Service-Error` headers (the NATS micro convention), never as silence.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, Status, StatusCode

from polyserve.shared import batching, durable

logger = logging.getLogger(__name__)

T = TypeVar("T")
ERROR_CODE = "Nats-Service-Error-Code"
ERROR_DESC = "Nats-Service-Error"

_encoder = msgspec.json.Encoder()
RECONNECT_WAIT_S = 0.25  # between tries of one server; the cluster's other nodes are tried at once
RECONNECT_BUFFER_MB = 64  # what a connection holds while reconnecting (env POLYSERVE_NATS_RECONNECT_BUFFER_MB)
PING_INTERVAL_S, MAX_OUTSTANDING_PINGS = 5, 2  # nats-py's stale-connection check: reconnect after ~10-15 s
PING_WAIT_S = 60.0  # how long Bus.ping's one PING may stay unanswered: far beyond the stale check


def split_urls(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` (POLYSERVE_NATS_URL) as a list; a bare `host:port` gets nats://."""
    return [u if "://" in u else f"nats://{u}" for u in (x.strip() for x in url.split(",")) if u]


def connect_options(url: str) -> dict[str, Any]:
    """nats-py connect options for a comma-separated list of servers: the servers without
    userinfo, and the credentials of the first that has some as `user`/`password`, so servers
    the cluster announces (which carry none) authenticate the same way after a failover."""
    servers, user, password = [], None, None
    for u in split_urls(url):
        parts = urlsplit(u)
        if parts.username is not None and user is None:
            user, password = unquote(parts.username), unquote(parts.password or "")
        servers.append(urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", "")))
    opts: dict[str, Any] = {"servers": servers}
    if user is not None:
        opts.update(user=user, password=password)
    return opts


class BusError(Exception):
    """A service answered with an error, or nobody answered in time.

    `code` follows HTTP: 4xx the caller's fault, 503 nobody to answer, 504 timeout.
    """

    def __init__(self, code: int, description: str):
        super().__init__(f"{code}: {description}")
        self.code = code
        self.description = description


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, typ: type[T]) -> T:
    return msgspec.json.decode(data, type=typ)


def unsampled() -> bool:
    """Whether the current span belongs to a trace that is not sampled (recorded neither here
    nor, under the parent-based samplers every service uses, downstream). With no exporter
    (`telemetry.py` samples off) every request's trace is such a one, and its client spans and
    trace headers record nothing anywhere yet cost ~5% of the gateway's CPU (a span, a context
    attach and an inject per hop; docs/benchmarks/overhead.md): they are skipped. Without a
    current span a client span is still made: it starts a trace its tracer's sampler decides."""
    ctx = trace.get_current_span().get_span_context()
    return ctx.is_valid and not ctx.trace_flags.sampled


def trace_headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Current trace context as NATS headers (traceparent, tracestate), when it is sampled."""
    headers: dict[str, str] = dict(extra or {})
    if not unsampled():
        propagate.inject(headers)
    return headers


def error_of(msg: NatsMsg) -> BusError | None:
    headers = msg.headers or {}
    if ERROR_CODE in headers:
        try:
            code = int(headers[ERROR_CODE])
        except ValueError:
            code = 500
        return BusError(code, headers.get(ERROR_DESC, "error"))
    return None


Handler = Callable[[Any], Awaitable[Any]]


class _Handoff(asyncio.Queue):
    """The pending queue of a subscription that hands each message to a plain function as
    nats-py's read loop files it (`Bus._subscribe_direct`). A nats-py callback subscription
    queues each message for a task of its own, which then calls the callback: one more loop
    turn and task step per message, on every acceptance and token chunk the gateway reads and
    every generate request a worker takes (issue 15). Only for callbacks that never wait (put
    into a queue, spawn a task). It relies on two attributes of nats-py's Subscription
    (`_pending_queue`, `_pending_size`): every request of the test suite goes through it."""

    def __init__(self, sub: Any, fn: Callable[[NatsMsg], None]):
        super().__init__()
        self._sub, self._fn = sub, fn

    def put_nowait(self, msg: NatsMsg) -> None:  # called by nats-py's read loop
        self._sub._pending_size -= len(msg.data)  # counted as pending by nats-py; nothing is kept
        try:
            self._fn(msg)
        except Exception:  # noqa: BLE001 - the read loop must go on
            logger.exception("handler of %s failed", msg.subject)


class Bus:
    """A thin typed layer over one nats-py connection, shared by a service."""

    def __init__(self, nc: NATS, tracer: trace.Tracer, service: str,
                 max_concurrency: int = 256):
        self.nc = nc
        self.tracer = tracer
        self.service = service
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task] = set()
        self._sem = asyncio.Semaphore(max_concurrency)
        self.errors = 0
        self._mux: dict[str, asyncio.Queue] = {}
        self._mux_ids = itertools.count(1)
        self._mux_prefix = ""
        self._mux_sub: Any = None
        self._soon = batching.Pending(batching.batch_window_s())  # publish_soon's pending events
        self._soon_timer: asyncio.TimerHandle | None = None
        servers = len(nc.servers) if getattr(nc, "servers", None) else 1
        replicas = int(os.environ.get("POLYSERVE_NATS_EVENT_REPLICAS", "0") or 0) or durable.replicas_for(servers)
        self._replicas = replicas
        self.outbox = durable.Outbox(nc, replicas)  # terminal events until JetStream has them
        self._durable: list[durable.DurableSubscription] = []
        self._shared: dict[tuple[str, str], durable.DurableSubscription] = {}  # by (subject, queue)
        self._retries: set[asyncio.Task] = set()  # durable consumers waiting for JetStream
        self._ping: asyncio.Future | None = None  # Bus.ping's PING in flight
        # A tracer that samples nothing (no exporter: telemetry._sampler) records no server span
        # whatever the caller sent, so `serve` makes none: a span, a context extract and attach
        # per request answered were ~4% of a worker's CPU per request (py-spy, issue 15).
        self.records_spans = getattr(tracer, "sampler", None) is not ALWAYS_OFF

    @classmethod
    async def connect(cls, url: str, tracer: trace.Tracer, service: str, **kw: Any) -> "Bus":
        """Connect as `service`: credentials come as the URL's `user:password@`; reply
        inboxes live under `_INBOX.<service>.` so NATS permissions can keep them the
        service's own (docs/security.md). A server with TLS is verified against the CA file
        in env POLYSERVE_NATS_TLS_CA (else the system's CAs).

        `url` may list several servers, comma-separated (a NATS cluster): the connection
        fails over to another when its server dies. While it reconnects, publishes wait in
        a reconnect buffer of RECONNECT_BUFFER_MB (a 5 s blip of ~300 streams is ~15 MB of
        token chunks; nats-py's default of 2 MB refused them) and are sent on reconnect."""
        opts: dict[str, Any] = connect_options(url)
        ca = os.environ.get("POLYSERVE_NATS_TLS_CA", "")
        if ca:
            opts["tls"] = ssl.create_default_context(cafile=ca)
        buffer_mb = float(os.environ.get("POLYSERVE_NATS_RECONNECT_BUFFER_MB", RECONNECT_BUFFER_MB))
        nc = await nats.connect(name=service, max_reconnect_attempts=-1, reconnect_time_wait=RECONNECT_WAIT_S,
                                connect_timeout=2, inbox_prefix=f"_INBOX.{service}",
                                pending_size=int(buffer_mb * 1024 * 1024), ping_interval=PING_INTERVAL_S,
                                max_outstanding_pings=MAX_OUTSTANDING_PINGS, **opts)
        return cls(nc, tracer, service, **kw)

    # ------------------------------------------------------------------ client side
    async def request(self, subject: str, msg: Any, reply_type: type[T], timeout: float,
                      span_name: str | None = None) -> T:
        """Send `msg`, wait for a typed reply; raise BusError on error/no responder/timeout."""
        if unsampled():
            return await self._request(subject, msg, reply_type, timeout)
        with self.tracer.start_as_current_span(span_name or f"request {subject}", kind=SpanKind.CLIENT):
            return await self._request(subject, msg, reply_type, timeout)

    async def _request(self, subject: str, msg: Any, reply_type: type[T], timeout: float) -> T:
        try:
            reply = await self.nc.request(subject, encode(msg), timeout=timeout, headers=trace_headers() or None)
        except NoRespondersError as exc:
            raise BusError(503, f"no service is listening on {subject}") from exc
        except (NatsTimeout, asyncio.TimeoutError) as exc:
            raise BusError(504, f"no answer on {subject} within {timeout:.1f}s") from exc
        err = error_of(reply)
        if err is not None:
            raise err
        return decode(reply.data, reply_type)

    async def publish(self, subject: str, msg: Any, reply: str = "") -> None:
        if not reply and durable.prefix_of(subject) is not None:  # completed/failed: kept until stored
            await self.outbox.publish(subject, encode(msg), trace_headers())
            return
        await self.nc.publish(subject, encode(msg), reply=reply, headers=trace_headers() or None)

    def publish_soon(self, subject: str, msg: Any) -> None:
        """Publish the event `msg` soon, with the events of every other caller: one socket write
        for them all, and one message per subject (`shared/batching.py`: a lone event leaves
        within 2 ms; while events keep coming, a subject's are sent once per batch window, as a
        JSON array). For what no one waits on (events): a write to nats-server was the gateway's
        largest single cost per request (py-spy; the client writes what is pending once per loop
        iteration, so publishes in different iterations each cost one), and every message a
        consumer's wake-up. Encoded now, without trace headers: events name their request and
        no consumer reads a trace context from them, while injecting one cost ~1% of the
        gateway's CPU (5 events per request; cProfile, docs/benchmarks/overhead.md).
        `flush_soon()` sends what is pending at once."""
        self._soon.add(subject, encode(msg))
        if self._soon_timer is None:
            self._soon_timer = asyncio.get_running_loop().call_later(self._soon.delay(), self._send_soon)

    def _send_soon(self) -> None:
        self._soon_timer = None
        if self._soon:
            self._spawn(self.flush_soon())

    async def flush_soon(self) -> None:
        """Send the events of `publish_soon` now (best effort: logged when NATS refuses)."""
        for subject, data in self._soon.take(durable.prefix_of):
            try:  # nc.publish only queues: one write after the loop
                if durable.prefix_of(subject) is not None:  # completed/failed: kept until stored
                    await self.outbox.publish(subject, data, {})
                else:
                    await self.nc.publish(subject, data)
            except Exception as exc:  # noqa: BLE001 - events are best effort
                logger.warning("could not publish on %s: %s", subject, exc)

    @asynccontextmanager
    async def inbox(self, max_pending: int = 10_000) -> AsyncIterator[tuple[str, asyncio.Queue]]:
        """A private inbox whose messages land in a bounded queue (`open_inbox`, closed on exit)."""
        subject, queue = await self.open_inbox(max_pending)
        try:
            yield subject, queue
        finally:
            self.close_inbox(subject)

    async def open_inbox(self, max_pending: int = 10_000) -> tuple[str, asyncio.Queue]:
        """A private inbox (its subject) whose messages land in a bounded queue, until
        `close_inbox(subject)`. All inboxes of this connection share one wildcard subscription
        (made on first use), so opening and closing one costs no SUB/UNSUB round on the wire:
        socket writes are most of the gateway's CPU time per request (py-spy, see README).
        A pair of calls rather than only the context manager: the gateway opens one per request,
        and a generator-based context manager on an exit stack cost it ~1% of its CPU (issue 15)."""
        if self._mux_sub is None:
            self._mux_prefix = self.nc.new_inbox()
            self._mux_sub = await self._subscribe_direct(f"{self._mux_prefix}.*", self._on_mux)
        token = f"{next(self._mux_ids):x}"
        queue: asyncio.Queue = asyncio.Queue(maxsize=max_pending)
        self._mux[token] = queue
        return f"{self._mux_prefix}.{token}", queue

    def close_inbox(self, subject: str) -> None:
        """Messages to the inbox `subject` are dropped from now on."""
        self._mux.pop(subject.rsplit(".", 1)[-1], None)

    async def _subscribe_direct(self, subject: str, fn: Callable[[NatsMsg], None], queue: str = "") -> Any:
        """A subscription whose messages go to `fn` from the read loop itself (`_Handoff`)."""
        sub = await self.nc.subscribe(subject, queue=queue)  # no callback: no task of its own
        sub._pending_queue = _Handoff(sub, fn)
        return sub

    def _on_mux(self, m: NatsMsg) -> None:
        queue = self._mux.get(m.subject.rsplit(".", 1)[-1])
        if queue is None:
            return  # the inbox was closed: a late message of a finished request
        try:
            queue.put_nowait(m)
        except asyncio.QueueFull:
            logger.error("inbox %s overflowed; dropping a message", m.subject)

    # ------------------------------------------------------------------ server side
    async def serve(self, subject: str, req_type: type, handler: Handler,
                    queue: str | None = None) -> None:
        """Answer requests on `subject`; the handler returns a struct or raises BusError."""

        def on_msg(m: NatsMsg) -> None:
            self._spawn(self._answer(m, req_type, handler, subject))

        self._subs.append(await self._subscribe_direct(subject, on_msg, queue=queue or ""))

    async def listen(self, subject: str, msg_type: type, handler: Handler, queue: str = "") -> None:
        """Consume events on `subject` (may hold wildcards); errors are logged, not replied.

        With `queue`, each event goes to one member of the queue group only. The terminal
        request events (`completed`, `failed`) come from a JetStream consumer
        (`shared/durable.py`): none is lost while this connection or its server restarts."""

        many = list[msg_type]  # type: ignore[valid-type]

        async def on_msg(m: NatsMsg) -> None:
            try:  # one event, or several in one message (`shared/batching.py`)
                objs = decode(m.data, many) if batching.is_batch(m.data) else (decode(m.data, msg_type),)
            except msgspec.DecodeError:
                self.errors += 1
                logger.warning("undecodable message on %s", m.subject)
                return
            for obj in objs:
                try:
                    await handler(obj)
                except Exception:
                    self.errors += 1
                    logger.exception("event handler for %s failed", m.subject)

        if durable.prefix_of(subject) is not None:
            shared = self._shared.get((subject, queue))
            if shared is not None:
                # One JetStream consumer per (subject, queue group) on this connection, whatever
                # the number of handlers (the gpu-agent has two for `completed`): each consumer
                # costs a delivery and an ack per event in nats-server and here (issue 15).
                shared.add(on_msg)
                return
            sub = durable.DurableSubscription(self.nc, subject, self.service, queue, on_msg,
                                              self.nc._inbox_prefix.decode(), self._replicas)
            self._shared[(subject, queue)] = sub
            if await sub.start():
                self._durable.append(sub)
                return
            # JetStream not answering (a cluster electing its leaders, or JetStream off): core
            # NATS meanwhile, the consumer as soon as JetStream answers
            logger.warning("%s: %s over core NATS until JetStream answers", self.service, subject)
            core = await self.nc.subscribe(subject, queue=queue, cb=sub.dedupe(sub.handle))
            self._subs.append(core)

            async def switch() -> None:
                self._durable.append(sub)
                if core in self._subs:
                    self._subs.remove(core)
                    await core.unsubscribe()
                logger.info("%s: %s from JetStream now", self.service, subject)

            task = asyncio.ensure_future(sub.start_later(switch))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)
            return
        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, m: NatsMsg, req_type: type, handler: Handler, subject: str) -> None:
        async with self._sem:
            if not self.records_spans:
                await self._handle(m, req_type, handler, subject, None)
                return
            ctx = propagate.extract(m.headers or {})
            with self.tracer.start_as_current_span(f"{self.service} {subject.rsplit('.', 1)[-1]}",
                                                   context=ctx, kind=SpanKind.SERVER) as span:
                await self._handle(m, req_type, handler, subject, span)

    async def _handle(self, m: NatsMsg, req_type: type, handler: Handler, subject: str, span: Any) -> None:
        """Decode, run `handler`, reply with its result or the error (`span`: None when not traced)."""
        try:
            req = decode(m.data, req_type)
            result = await handler(req)
            if m.reply:
                await self.nc.publish(m.reply, encode(result))
        except BusError as exc:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, exc.description))
            await self._reply_error(m, exc.code, exc.description)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.errors += 1
            await self._reply_error(m, 400, f"invalid {req_type.__name__}: {exc}")
        except Exception as exc:
            self.errors += 1
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
            logger.exception("handler for %s failed", subject)
            await self._reply_error(m, 500, f"{type(exc).__name__}: {exc}")

    async def _reply_error(self, m: NatsMsg, code: int, description: str) -> None:
        if not m.reply:
            return
        try:
            await self.nc.publish(m.reply, b"", headers={ERROR_CODE: str(code), ERROR_DESC: description[:500]})
        except Exception:
            logger.exception("could not send error reply")

    # ------------------------------------------------------------------ health
    async def ping(self, timeout: float) -> bool:
        """Whether nats-server answers a PING within `timeout` seconds. One PING in flight at a
        time, and it is never cancelled: nats-py's `flush(timeout)` cancels its PONG future
        when it times out, and the late PONG (a paused or busy server answers eventually) then
        raises InvalidStateError inside the client's read loop, which ends it. The connection
        still says "connected" but reads nothing (no reply, heartbeat or token) until the
        stale-connection check reconnects, 10-15 s later: a 5 s NATS stall cost the gateway
        every request in flight (the chaos nats-pause scenario; tests/integration/test_bus.py).
        So the PING waits up to PING_WAIT_S, beyond that check (a reconnect drops nats-py's
        PONG futures, and a timeout on an orphaned one harms nothing); callers only stop
        waiting for it."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(self.nc.flush(timeout=PING_WAIT_S))
            self._ping.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        ping = self._ping
        done, _ = await asyncio.wait({ping}, timeout=timeout)
        return bool(done) and not ping.cancelled() and ping.exception() is None

    async def sync(self, timeout: float = 10.0) -> None:
        """Wait until nats-server has what was written so far (subscriptions included); BusError
        504 when it does not answer within `timeout` (`ping`: never nats-py's flush timeout).
        A PING already in flight went out before the latest writes: its PONG is waited for
        first, then a PING of this call's own answers."""
        end = time.monotonic() + timeout
        if self._ping is not None and not self._ping.done():
            await asyncio.wait({self._ping}, timeout=timeout)
        if not await self.ping(max(0.0, end - time.monotonic())):
            raise BusError(504, f"nats-server did not answer a PING within {timeout:g}s")

    # ------------------------------------------------------------------ lifecycle
    async def stop_intake(self) -> None:
        """Unsubscribe every handler so no new work arrives."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs.clear()
        for task in list(self._retries):
            task.cancel()
        for dsub in self._durable:
            await dsub.close(delete=True)
        self._durable.clear()
        self._shared.clear()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait for in-flight handlers; True when all finished in time."""
        if not self._tasks:
            return True
        done, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in pending:
            task.cancel()
        return not pending

    async def close(self) -> None:
        if self._soon_timer is not None:
            self._soon_timer.cancel()
            self._soon_timer = None
        await self.flush_soon()
        await self.outbox.close(timeout=2.0)
        for task in list(self._retries):
            task.cancel()
        for dsub in self._durable:
            await dsub.close(delete=True)
        try:
            await self.nc.drain()
        except Exception:
            try:
                await self.nc.close()
            except Exception:
                pass
