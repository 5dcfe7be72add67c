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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

logger = logging.getLogger(__name__)

T = TypeVar("T")
ERROR_CODE = "Nats-Service-Error-Code"
ERROR_DESC = "Nats-Service-Error"

_encoder = msgspec.json.Encoder()
COALESCE_S = 0.002  # publish_soon's window: events reach subscribers at most this much later


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


def trace_headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Current trace context as NATS headers (traceparent, tracestate)."""
    headers: dict[str, str] = dict(extra or {})
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
        self._soon: list[tuple[str, bytes, dict[str, str]]] = []  # publish_soon's pending messages
        self._soon_timer: asyncio.TimerHandle | None = None

    @classmethod
    async def connect(cls, url: str, tracer: trace.Tracer, service: str, **kw: Any) -> "Bus":
        """Connect as `service`: credentials come as the URL's `user:password@`; reply
        inboxes live under `_INBOX.<service>.` so NATS permissions can keep them the
        service's own (docs/security.md). A server with TLS is verified against the CA file
        in env POLYSERVE_NATS_TLS_CA (else the system's CAs)."""
        opts: dict[str, Any] = {}
        ca = os.environ.get("POLYSERVE_NATS_TLS_CA", "")
        if ca:
            opts["tls"] = ssl.create_default_context(cafile=ca)
        nc = await nats.connect(url, name=service, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                connect_timeout=2, inbox_prefix=f"_INBOX.{service}", **opts)
        return cls(nc, tracer, service, **kw)

    # ------------------------------------------------------------------ client side
    async def request(self, subject: str, msg: Any, reply_type: type[T], timeout: float,
                      span_name: str | None = None) -> T:
        """Send `msg`, wait for a typed reply; raise BusError on error/no responder/timeout."""
        with self.tracer.start_as_current_span(span_name or f"request {subject}", kind=SpanKind.CLIENT):
            try:
                reply = await self.nc.request(subject, encode(msg), timeout=timeout,
                                              headers=trace_headers())
            except NoRespondersError as exc:
                raise BusError(503, f"no service is listening on {subject}") from exc
            except (NatsTimeout, asyncio.TimeoutError) as exc:
                raise BusError(504, f"no answer on {subject} within {timeout:.1f}s") from exc
            err = error_of(reply)
            if err is not None:
                raise err
            return decode(reply.data, reply_type)

    async def publish(self, subject: str, msg: Any, reply: str = "") -> None:
        await self.nc.publish(subject, encode(msg), reply=reply, headers=trace_headers())

    def publish_soon(self, subject: str, msg: Any) -> None:
        """Publish `msg` within `COALESCE_S`, with the messages of every other caller in that
        window: one socket write for them all. For what no one waits on (events): a write to
        nats-server was the gateway's largest single cost per request (py-spy; the client writes
        what is pending once per loop iteration, so publishes in different iterations each cost
        one). Encoded and trace headers taken now; `flush_soon()` sends what is pending at once."""
        self._soon.append((subject, encode(msg), trace_headers()))
        if self._soon_timer is None:
            self._soon_timer = asyncio.get_running_loop().call_later(COALESCE_S, self._send_soon)

    def _send_soon(self) -> None:
        self._soon_timer = None
        if self._soon:
            self._spawn(self.flush_soon())

    async def flush_soon(self) -> None:
        """Send the messages of `publish_soon` now (best effort: logged when NATS refuses)."""
        batch, self._soon = self._soon, []
        for subject, data, headers in batch:  # nc.publish only queues: one write after the loop
            try:
                await self.nc.publish(subject, data, headers=headers)
            except Exception as exc:  # noqa: BLE001 - events are best effort
                logger.warning("could not publish on %s: %s", subject, exc)

    @asynccontextmanager
    async def inbox(self, max_pending: int = 10_000) -> AsyncIterator[tuple[str, asyncio.Queue]]:
        """A private inbox whose messages land in a bounded queue.

        All inboxes of this connection share one wildcard subscription (made on first
        use), so opening and closing one costs no SUB/UNSUB round on the wire: socket
        writes are most of the gateway's CPU time per request (py-spy, see README)."""
        if self._mux_sub is None:
            self._mux_prefix = self.nc.new_inbox()
            self._mux_sub = await self.nc.subscribe(f"{self._mux_prefix}.*", cb=self._on_mux)
        token = f"{next(self._mux_ids):x}"
        queue: asyncio.Queue = asyncio.Queue(maxsize=max_pending)
        self._mux[token] = queue
        try:
            yield f"{self._mux_prefix}.{token}", queue
        finally:
            self._mux.pop(token, None)

    async def _on_mux(self, m: NatsMsg) -> None:
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

        async def on_msg(m: NatsMsg) -> None:
            self._spawn(self._answer(m, req_type, handler, subject))

        self._subs.append(await self.nc.subscribe(subject, queue=queue or "", cb=on_msg))

    async def listen(self, subject: str, msg_type: type, handler: Handler, queue: str = "") -> None:
        """Consume events on `subject` (may hold wildcards); errors are logged, not replied.

        With `queue`, each event goes to one member of the queue group only."""

        async def on_msg(m: NatsMsg) -> None:
            try:
                obj = decode(m.data, msg_type)
            except msgspec.DecodeError:
                self.errors += 1
                logger.warning("undecodable message on %s", m.subject)
                return
            try:
                await handler(obj)
            except Exception:
                self.errors += 1
                logger.exception("event handler for %s failed", m.subject)

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, m: NatsMsg, req_type: type, handler: Handler, subject: str) -> None:
        ctx = propagate.extract(m.headers or {})
        async with self._sem:
            with self.tracer.start_as_current_span(f"{self.service} {subject.rsplit('.', 1)[-1]}",
                                                   context=ctx, kind=SpanKind.SERVER) as span:
                try:
                    req = decode(m.data, req_type)
                    result = await handler(req)
                    if m.reply:
                        await self.nc.publish(m.reply, encode(result))
                except BusError as exc:
                    span.set_status(Status(StatusCode.ERROR, exc.description))
                    await self._reply_error(m, exc.code, exc.description)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self.errors += 1
                    await self._reply_error(m, 400, f"invalid {req_type.__name__}: {exc}")
                except Exception as exc:
                    self.errors += 1
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

    # ------------------------------------------------------------------ lifecycle
    async def stop_intake(self) -> None:
        """Unsubscribe every handler so no new work arrives."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs.clear()

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
        try:
            await self.nc.drain()
        except Exception:
            try:
                await self.nc.close()
            except Exception:
                pass
