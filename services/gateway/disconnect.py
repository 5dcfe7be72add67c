"""Noticing a client that went away, without a task per request (issue 15).

`watched(request, work)` awaits `work` in the request's own task; every `PROBE_S` a timer asks
`request.is_disconnected()` and, when the client is gone, cancels that task and raises
`ClientGone` (the work is cancelled at its await: a RequestRun cancels its request at the
worker). `EventStream` is a StreamingResponse that streams so: under ASGI spec 2.3, which uvicorn
speaks, Starlette streams a response in an anyio task group with a second task that waits for
the disconnect, which cost 82 µs per streamed response on this project's machine against 5 µs
for the stream itself (three chunks; docs/benchmarks/overhead.md, sixth session). The price is
that a client's departure is noticed up to `PROBE_S` later (uvicorn drops what is sent after it)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .errors import GatewayError
from .handlers import RequestRun
from .outcome import Outcome

PROBE_S = 0.5
T = TypeVar("T")


class ClientGone(Exception):
    """The client of the request went away while `watched` work ran."""


async def watched(request: Request, work: Awaitable[T]) -> T:
    """`await work` in this task; ClientGone (and `work` cancelled) once the client has gone."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    left = False
    checking: asyncio.Future | None = None

    async def probe() -> None:
        nonlocal left, timer
        if await request.is_disconnected():
            left = True
            me.cancel()
        else:
            timer = loop.call_later(PROBE_S, tick)

    def tick() -> None:
        nonlocal checking
        checking = asyncio.ensure_future(probe())

    timer = loop.call_later(PROBE_S, tick)
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        me.uncancel()
        raise ClientGone from None
    finally:
        timer.cancel()
        if checking is not None:
            checking.cancel()


async def collect(request: Request, run: RequestRun) -> Outcome:
    """`run.collect()` in this task; a client that goes away cancels the request at its worker
    and the request fails 499."""
    try:
        return await watched(request, run.collect())
    except ClientGone:
        await run.cancel("client disconnected")
        raise GatewayError(499, "client disconnected") from None


class EventStream(StreamingResponse):
    """A server-sent event stream written in the request's own task (`watched`)."""

    def __init__(self, content, request: Request, **kwargs):
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.request = request

    async def __call__(self, scope, receive, send) -> None:
        try:
            await watched(self.request, self.stream_response(send))
        except ClientGone:
            pass  # the body's generator was cancelled where it waited (it cleans up there)
