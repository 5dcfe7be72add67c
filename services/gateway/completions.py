"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`: validate the
body, `admit()` it (admission.py), run it (handlers.RequestRun) and answer in one JSON
body or as server-sent events."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from . import policy
from .admission import Admission, admit
from .context import Gateway, GatewayState
from .errors import GatewayError
from .handlers import Outcome, RequestRun
from .schemas import ChatBody, CompletionBody


def add_completion_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])


async def completions(body: CompletionBody, request: Request, gs: Gateway) -> Response:
    return await serve(gs, request, body, policy.completion_prompt(body), chat=False)


async def chat(body: ChatBody, request: Request, gs: Gateway) -> Response:
    return await serve(gs, request, body, policy.render_chat(body.messages), chat=True)


async def serve(gs: GatewayState, request: Request, body: CompletionBody | ChatBody, prompt: str,
                chat: bool) -> Response:
    """Validate, admit and run one completion; a stream keeps the in-flight slot until it ends."""
    s = gs.settings
    if len(prompt) > s.max_prompt_chars:
        raise policy.InvalidRequest(f"prompt is {len(prompt)} characters; the limit is {s.max_prompt_chars}",
                                    "prompt")
    params = policy.sampling_params(body, default_max_tokens=s.default_max_tokens,
                                    max_tokens_limit=s.max_tokens_limit, max_n=s.max_n)
    adm = await admit(gs, body.model, adapter=body.adapter)
    run = RequestRun(gs=gs, deployment=adm.deployment, prompt=prompt, params=params, stream=body.stream,
                     adapter=adm.adapter, priority=body.priority)
    span = adm.begin("gateway " + ("chat" if chat else "completion"), request.headers)
    span.set_attribute("polyserve.request_id", run.request_id)
    handed_off = False
    try:
        with trace.use_span(span, end_on_exit=False):
            await run.start()
        if body.stream:
            handed_off = True
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(adm, run, chat, include_usage), media_type="text/event-stream",
                                     headers=_sim_header(adm.deployment.engine == "sim"))
        with trace.use_span(span, end_on_exit=False):
            out = await _collect(request, run)
        return JSONResponse(policy.full_response(
            chat=chat, request_id=run.request_id, model=adm.deployment.id, texts=out.texts, finish=out.finish,
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            simulated=out.simulated), headers=_sim_header(out.simulated))
    except GatewayError as exc:
        adm.failed(exc)
        raise
    finally:
        if not handed_off:
            adm.end()


async def _collect(request: Request, run: RequestRun) -> Outcome:
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


async def _stream(adm: Admission, run: RequestRun, chat: bool, include_usage: bool):
    """The SSE body; an error after the first byte goes out as an error chunk."""
    firsts: set[int] = set()
    model = run.deployment.id
    try:
        with trace.use_span(adm.span, end_on_exit=False):
            async for chunk in run.chunks():
                if chunk.done:
                    if include_usage and chunk.stats:
                        yield _sse(policy.usage_chunk(chat=chat, request_id=run.request_id, model=model,
                                                      prompt_tokens=chunk.stats.input_tokens,
                                                      completion_tokens=chunk.stats.output_tokens))
                    continue  # chunks() ends after the done chunk
                if not chunk.text and not chunk.finish_reason:
                    continue
                yield _sse(policy.stream_chunk(chat=chat, request_id=run.request_id, model=model,
                                               index=chunk.index, text=chunk.text,
                                               finish_reason=chunk.finish_reason,
                                               first=chunk.index not in firsts, simulated=chunk.simulated))
                firsts.add(chunk.index)
        yield b"data: [DONE]\n\n"
    except GatewayError as exc:
        adm.failed(exc)
        yield _sse(policy.error_body(exc.message, policy.error_type(exc.status), code=str(exc.status)))
    finally:
        adm.end()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _sim_header(simulated: bool | None) -> dict[str, str] | None:
    return {"X-Polyserve-Simulated": "true"} if simulated else None
