"""The gateway's HTTP edges (issue 14): limits enforced before a request body is parsed.

- `EdgeLimits`, an ASGI middleware (outside FastAPI's routing): a body whose Content-Length
  is above `max_body_bytes` is answered 413 without reading a byte of it; a body without one
  (chunked) is counted as it arrives and the request fails 413 as soon as it passes the limit
  (nothing more is read). The whole body must arrive within `body_timeout_s` (slow-body
  clients get 408). While the request runs, `current()` gives the request-shape limits
  (messages, stop strings) the pydantic models in schemas.py check.
- `header_timeout_protocol`: a uvicorn h11 protocol that closes a connection whose request
  headers are not complete within `header_timeout_s` (slow-header clients hold no socket).
- `raise_nofile_limit`: the file-descriptor soft limit up to the hard limit, at start.

Connection cap and keep-alive are uvicorn's own (`limit_concurrency`: a clean 503 beyond it;
`timeout_keep_alive`); `uvicorn_kwargs` maps the gateway settings onto uvicorn.Config.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException

from . import errors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """Request-shape limits the body models check (schemas.py); defaults as GatewaySettings'."""

    max_messages: int = 2048
    max_stop: int = 4
    max_stop_chars: int = 1024


_LIMITS: contextvars.ContextVar[RequestLimits] = contextvars.ContextVar("polyserve_request_limits",
                                                                         default=RequestLimits())


def current() -> RequestLimits:
    """The limits of the gateway serving the current request (the defaults outside one)."""
    return _LIMITS.get()


class BodyTooLarge(HTTPException):
    """413: FastAPI re-raises HTTPExceptions from the body read, errors.py renders the envelope."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than this gateway's limit of {limit} bytes "
                              f"(setting max_body_bytes); send a smaller request")


class BodyTimeout(HTTPException):
    def __init__(self, seconds: float):
        super().__init__(408, f"the request body did not arrive within {seconds:g} s "
                              f"(setting body_timeout_s)")


def _declared_length(scope: dict) -> tuple[int | None, bool]:
    """(Content-Length or None, whether a body comes at all)."""
    length, chunked = None, False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                pass  # the HTTP parser refuses it
        elif name == b"transfer-encoding":
            chunked = True
    return length, chunked or bool(length)


async def _send_error(send, exc: HTTPException) -> None:
    await errors.send_error(send, exc.status_code, exc.detail, type_="invalid_request_error",
                            code="request_too_large" if exc.status_code == 413 else "request_timeout",
                            headers=((b"connection", b"close"),))


class EdgeLimits:
    """ASGI middleware: body size (413) and body time (408) limits, request-shape limits in context."""

    def __init__(self, app, *, max_body_bytes: int, body_timeout_s: float, limits: RequestLimits):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _LIMITS.set(self.limits)
        try:
            declared, has_body = _declared_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                await _send_error(send, BodyTooLarge(self.max_body_bytes))  # not a byte of it read
                return
            await self._guarded(scope, receive, send, has_body)
        finally:
            _LIMITS.reset(token)

    async def _guarded(self, scope, receive, send, has_body: bool) -> None:
        seen, done, started = 0, not has_body, False
        deadline = time.monotonic() + self.body_timeout_s

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen, done
            if done or started:  # the body is in (or the app answers): receives wait for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except (BodyTooLarge, BodyTimeout) as exc:  # read outside FastAPI's routing (no handler ran)
            if not started:
                await _send_error(send, exc)


def install(app, settings) -> None:
    """Add `EdgeLimits` to a FastAPI/Starlette app with the gateway settings' values."""
    app.add_middleware(EdgeLimits, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s,
                       limits=RequestLimits(max_messages=settings.max_messages, max_stop=settings.max_stop,
                                            max_stop_chars=settings.max_stop_chars))


def header_timeout_protocol(seconds: float):
    """A uvicorn h11 protocol class (uvicorn.Config(http=...)) that closes a connection whose
    request headers are not complete `seconds` after it opened or after the next request's first
    bytes arrived (an idle kept-alive connection is uvicorn's `timeout_keep_alive`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _timed_cycle: object = None

        def _arm(self) -> None:
            self._disarm()
            self._timed_cycle = self.cycle
            self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._timed_cycle and not self.transport.is_closing():
                self.transport.close()  # no request line and headers in time: drop the connection

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of a kept-alive connection's next request
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._timed_cycle:
                self._disarm()  # headers complete: the request runs (the body has its own limit)

    return HeaderTimeoutH11Protocol


def header_timeout_httptools_protocol(seconds: float):
    """The same slow-header guard for uvicorn's httptools protocol (the C parser the gateway
    uses where installed): the timer is armed when a connection opens and when the parser sees
    the next request begin, and disarmed when its headers are complete."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()  # no request line and headers in time: drop the connection

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            if self._header_timer is None:
                self._arm()  # the first bytes of a kept-alive connection's next request
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()  # headers complete: the request runs (the body has its own limit)
            super().on_headers_complete()

    return HeaderTimeoutHttpToolsProtocol


def uvicorn_kwargs(settings, http: str = "h11") -> dict[str, Any]:
    """The uvicorn.Config keyword arguments for the gateway's edge settings, for the HTTP
    implementation `http` ("httptools" or "h11"): the connection cap (503 beyond it), the
    keep-alive idle timeout and the slow-header timeout; the header size cap is h11's
    (httptools bounds a header line by its own fixed buffer)."""
    kwargs: dict[str, Any] = {"limit_concurrency": settings.max_connections or None,
                              "timeout_keep_alive": max(1, int(settings.keep_alive_s))}
    if http == "httptools":
        kwargs["http"] = header_timeout_httptools_protocol(settings.header_timeout_s)
    else:
        kwargs["http"] = header_timeout_protocol(settings.header_timeout_s)
        kwargs["h11_max_incomplete_event_size"] = settings.max_header_bytes
    return kwargs


def raise_nofile_limit() -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit (capped at 1,048,576), where the OS lets us;
    returns the (soft, hard) limits now in force, or None where there is no such limit."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft, hard
