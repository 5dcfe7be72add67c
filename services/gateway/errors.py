"""How the gateway fails a request: `GatewayError` (an HTTP status and a message for the
client), bus errors mapped to it, and the OpenAI error envelope every error answers with."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyserve.shared.bus import BusError

from . import policy


class GatewayError(Exception):
    """Ends a request with an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def status_of(exc: BusError, what: str) -> GatewayError:
    """The client's view of a failed bus request to `what` (a service or a worker)."""
    if exc.code == 504:
        return GatewayError(504, f"{what} did not answer in time: {exc.description}")
    if exc.code == 503:
        return GatewayError(503, f"{what} unavailable: {exc.description}", retry_after=1)
    if exc.code == 429:
        return GatewayError(429, exc.description, retry_after=1)
    return GatewayError(exc.code if 400 <= exc.code < 600 else 502, exc.description)


async def send_error(send, status: int, message: str, *, type_: str | None = None, code: str | None = None,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """The OpenAI error envelope sent by a raw ASGI middleware (`send`), before any route runs:
    edge limits, client keys, load shedding. `headers` are added to the content headers."""
    body = json.dumps(policy.error_body(message, type_ or policy.error_type(status), None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(int(max(1, retry_after)))} if retry_after else None
    return JSONResponse(policy.error_body(message, policy.error_type(status), param, code),
                        status_code=status, headers=headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    where = ".".join(loc) or "body"
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", None)
    return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", where or None)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
    return error_response(exc.status, exc.message, retry_after=exc.retry_after)


async def _bad(request: Request, exc: policy.InvalidRequest) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _unencodable(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
    """Text no service can take (a lone surrogate in a field the endpoint did not check
    itself; prompts and messages are checked up front, policy.check_text): the client's fault."""
    return error_response(400, f"the request holds text that is not valid Unicode ({exc.reason}: "
                               f"{exc.object[exc.start:exc.end]!r}); send well-formed UTF-8 text",
                          code="invalid_unicode")


def add_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own included, answers with the OpenAI error envelope."""
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(GatewayError, _gateway)
    app.add_exception_handler(policy.InvalidRequest, _bad)
    app.add_exception_handler(UnicodeEncodeError, _unencodable)
