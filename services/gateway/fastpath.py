"""A shorter way in for the two hottest routes (issue 15): `POST /v1/completions` and
`POST /v1/chat/completions` with a JSON body that validates go from the gateway's own
middlewares (Retire, Shed, Access, EdgeLimits: all of them still run) straight to their
endpoint functions, past FastAPI's routing, dependency solving and per-route exception and
exit-stack wrappers. py-spy put that machinery at about a third of the gateway's Python time per
request, several times what the endpoint's own ASGI work costs (docs/benchmarks/overhead.md,
"sixth session"). FastAPI has no per-route switch for it, hence this middleware.

What a request sees does not change: the same endpoint function with the same body model, the
same route dependency (`access.client_limits`, once), the same error envelopes (errors.py's
handlers). Anything this path does not handle exactly as FastAPI would goes to FastAPI with
its body replayed: another method or path, a content type FastAPI would not parse as JSON, an
empty body, a body that is not JSON or does not validate (FastAPI then words the 400 itself).
The routes stay registered with FastAPI, so the OpenAPI schema and the fallback are its own."""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from fastapi import Request

from . import access, completions
from .context import GatewayState
from .schemas import ChatBody, CompletionBody

# path -> (body model, endpoint function); the functions FastAPI routes the same paths to
ROUTES: dict[str, tuple[type[pydantic.BaseModel], Callable[..., Awaitable[Any]]]] = {
    "/v1/completions": (CompletionBody, completions.completions),
    "/v1/chat/completions": (ChatBody, completions.chat),
}


def json_content(scope: dict) -> bool:
    """Whether FastAPI would parse this request's body as JSON: a content type of
    application/json or application/*+json (FastAPI's strict default: none given is not JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    return False


class FastRoutes:
    """ASGI middleware, the innermost of the gateway's own (app.build_app)."""

    def __init__(self, app, gs: GatewayState, handlers: dict):
        # `handlers`: the FastAPI app's `exception_handlers` (errors.py adds them), the same dict
        # its ExceptionMiddleware reads; 500 / Exception belong to ServerErrorMiddleware, outside.
        self.app, self.gs, self.handlers = app, gs, handlers

    async def __call__(self, scope, receive, send) -> None:
        route = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not json_content(scope):
            return await self.app(scope, receive, send)
        messages = await _read_body(receive)  # EdgeLimits' 413/408 are raised from here and answered by it
        replay = _Replay(list(messages), receive)
        body = _parse(route[0], messages)
        if body is None:
            return await self.app(scope, replay, send)  # FastAPI words the 400 (or parses what we did not)
        request = Request(scope, replay)
        try:
            await access.client_limits(request, self.gs)
            response = await route[1](body, request, self.gs)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, replay, send)

    def _handler(self, exc: Exception):
        """The handler Starlette's ExceptionMiddleware picks for `exc`: the first class of its MRO
        that has one."""
        for cls in type(exc).__mro__:
            if cls is not Exception and cls in self.handlers:
                return self.handlers[cls]
        return None


def _parse(model: type[pydantic.BaseModel], messages: list[dict]) -> pydantic.BaseModel | None:
    """The body as FastAPI would give it to the endpoint (json.loads as Starlette's
    `Request.json`, then python-mode validation), or None where FastAPI would answer a 400 or
    the body did not come whole (the client left)."""
    if messages[-1]["type"] != "http.request":
        return None
    raw = b"".join(m.get("body", b"") for m in messages)
    if not raw:
        return None
    try:
        return model.model_validate(json.loads(raw))
    except Exception:  # noqa: BLE001 - not JSON, invalid, or too deeply nested (RecursionError): FastAPI answers
        return None


async def _read_body(receive) -> list[dict]:
    """The request's body messages, up to the last one (or the client's disconnect)."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


class _Replay:
    """An ASGI `receive` that hands out the messages already read, then waits as the original
    does (for the client's disconnect)."""

    def __init__(self, messages: list[dict], receive):
        self.messages = messages
        self.receive = receive

    async def __call__(self) -> dict[str, Any]:
        if self.messages:
            return self.messages.pop(0)
        return await self.receive()
