"""FastAPI routes: OpenAI-compatible endpoints, health, metrics; admin routes in admin.py."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import policy
from .admin import add_admin_routes
from .embeddings import add_embedding_routes
from .handlers import GatewayError, RequestRun
from .schemas import ChatBody, CompletionBody

if TYPE_CHECKING:
    from .service import GatewayService

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(int(max(1, retry_after)))} if retry_after else None
    return JSONResponse(policy.error_body(message, policy.error_type(status), param, code),
                        status_code=status, headers=headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def build_app(gw: "GatewayService") -> FastAPI:
    app = FastAPI(title="polyserve gateway", version="0.1.0")
    s = gw.settings

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        where = ".".join(loc) or "body"
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", None)
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(GatewayError)
    async def _gw(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc.status, exc.message, retry_after=exc.retry_after)

    @app.exception_handler(policy.InvalidRequest)
    async def _bad(request: Request, exc: policy.InvalidRequest) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ok = gw.ready.is_set() and not gw.draining and gw.bus is not None and gw.bus.nc.is_connected
        return JSONResponse({"ready": ok, "draining": gw.draining}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        deps = await gw.refresh_deployments()
        data = [{"id": d.id, "object": "model", "created": int(d.created), "owned_by": "polyserve",
                 "root": d.model, "parent": None, "engine": d.engine, "policy": d.policy} for d in deps.values()]
        data += [{"id": a.name, "object": "model", "created": int(a.created), "owned_by": "polyserve",
                  "root": a.path, "parent": a.deployment, "lora_rank": a.rank}
                 for a in gw.adapters.values() if a.deployment in deps]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _serve(request, body, policy.completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        return await _serve(request, body, policy.render_chat(body.messages), chat=True)

    async def _serve(request: Request, body: CompletionBody | ChatBody, prompt: str, chat: bool) -> Response:
        if gw.draining:
            gw.metrics.rejected.labels("draining").inc()
            raise GatewayError(503, "the gateway is shutting down; retry on another instance", retry_after=1)
        if gw.inflight >= s.max_inflight:
            gw.metrics.rejected.labels("overload").inc()
            raise GatewayError(429, f"too many requests in flight ({s.max_inflight}); retry shortly",
                               retry_after=1)
        if len(prompt) > s.max_prompt_chars:
            raise policy.InvalidRequest(f"prompt is {len(prompt)} characters; the limit is {s.max_prompt_chars}",
                                        "prompt")
        params = policy.sampling_params(body, default_max_tokens=s.default_max_tokens,
                                        max_tokens_limit=s.max_tokens_limit, max_n=s.max_n)
        try:
            deployment, adapter = await gw.find_deployment(body.model)
        except Exception as exc:
            raise GatewayError(503, f"cluster state unavailable: {exc}", retry_after=1) from exc
        if deployment is None:
            raise policy.InvalidRequest(f"The model '{body.model}' does not exist; GET /v1/models lists "
                                        "the served models", "model", 404, "model_not_found")
        if body.adapter:
            adapter = gw.adapters.get(body.adapter)
            if adapter is None or adapter.deployment != deployment.id:
                known = sorted(a.name for a in gw.adapters.values() if a.deployment == deployment.id)
                raise policy.InvalidRequest(f"unknown adapter '{body.adapter}' for '{deployment.id}'; "
                                            f"registered: {known or 'none'} (POST /v1/adapters)", "adapter", 404,
                                            "adapter_not_found")
        span = gw.tracer.start_span("gateway " + ("chat" if chat else "completion"), kind=SpanKind.SERVER,
                                    context=propagate.extract(dict(request.headers)))
        run = RequestRun(gw=gw, deployment=deployment, prompt=prompt, params=params, stream=body.stream,
                         adapter=adapter.name if adapter else None, adapter_path=adapter.path if adapter else "",
                         adapter_rank=adapter.rank if adapter else 0,
                         priority=body.priority)
        span.set_attribute("polyserve.request_id", run.request_id)
        gw.inflight += 1
        gw.metrics.inflight.inc()
        handed_off = False
        try:
            with trace.use_span(span, end_on_exit=False):
                await run.start()
            if body.stream:
                handed_off = True
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(_stream(run, span, chat, include_usage), media_type="text/event-stream",
                                         headers=_sim_header(deployment.engine == "sim"))
            with trace.use_span(span, end_on_exit=False):
                out = await _collect(request, run)
            return JSONResponse(policy.full_response(
                chat=chat, request_id=run.request_id, model=deployment.id, texts=out.texts, finish=out.finish,
                prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                simulated=out.simulated), headers=_sim_header(out.simulated))
        except GatewayError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.message))
            raise
        finally:
            if not handed_off:
                _done(gw, span)

    async def _collect(request: Request, run: RequestRun):
        """Collect a non-streamed answer; a client that goes away cancels it at the worker."""
        task = asyncio.ensure_future(run.collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    await run.cancel("client disconnected")
                    raise GatewayError(499, "client disconnected")
        finally:
            if not task.done():
                task.cancel()

    async def _stream(run: RequestRun, span, chat: bool, include_usage: bool):
        firsts: set[int] = set()
        try:
            with trace.use_span(span, end_on_exit=False):
                async for chunk in run.chunks():
                    if chunk.done:
                        if include_usage and chunk.stats:
                            yield _sse(policy.usage_chunk(chat=chat, request_id=run.request_id,
                                                          model=run.deployment.id,
                                                          prompt_tokens=chunk.stats.input_tokens,
                                                          completion_tokens=chunk.stats.output_tokens))
                        continue  # chunks() ends after the done chunk
                    if not chunk.text and not chunk.finish_reason:
                        continue
                    yield _sse(policy.stream_chunk(chat=chat, request_id=run.request_id, model=run.deployment.id,
                                                   index=chunk.index, text=chunk.text,
                                                   finish_reason=chunk.finish_reason,
                                                   first=chunk.index not in firsts, simulated=chunk.simulated))
                    firsts.add(chunk.index)
            yield b"data: [DONE]\n\n"
        except GatewayError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.message))
            yield _sse(policy.error_body(exc.message, policy.error_type(exc.status), code=str(exc.status)))
        finally:
            _done(gw, span)

    add_admin_routes(app, gw)
    add_embedding_routes(app, gw)
    return app


def _sim_header(simulated: bool | None) -> dict[str, str] | None:
    return {"X-Polyserve-Simulated": "true"} if simulated else None


def _done(gw: "GatewayService", span) -> None:
    gw.inflight -= 1
    gw.metrics.inflight.dec()
    span.end()
