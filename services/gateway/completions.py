"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`: validate the
body (compat.py refuses the fields polyserve does not honour), `admit()` it (admission.py),
run it (handlers.RequestRun) and answer in one JSON body or as server-sent events.

A completions request with a list of prompts is a batch: every prompt runs as a request
of its own (its own id `<id>-<i>`, prediction, placement and terminal event) under the
one admission; choice `j` of prompt `i` has index `i * n + j`, as OpenAI numbers them,
and usage is summed."""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from opentelemetry import trace

from polyserve.proto import ChatTurn, SamplingParams, TokenChunk

from . import compat, disconnect, logprobs, policy, reasoning, tools
from .admission import Admission, admit
from .context import Gateway, GatewayState
from .errors import GatewayError
from .handlers import RequestRun
from .outcome import Outcome, merge
from .schemas import ChatBody, CompletionBody


def add_completion_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])


async def completions(body: CompletionBody, request: Request, gs: Gateway) -> Response:
    return await serve(gs, request, body, policy.completion_prompts(body, gs.settings.max_prompts), chat=False)


async def chat(body: ChatBody, request: Request, gs: Gateway) -> Response:
    tl = tools.parse_tools(body)
    calls = any((m.model_extra or {}).get("tool_calls") for m in body.messages)
    end = policy.chat_end(body)
    extra = policy.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
    if tl.listed or calls:  # the transcript carries the tool definitions and calls, for a worker
        text = tools.render_chat(body.messages, tl, end)  # whose chat template does not take them itself
        return await serve(gs, request, body, [text], chat=True, tl=tl, turns=tools.chat_turns(body.messages),
                           chat_end=end, template_kwargs=extra)
    # the worker formats the messages with the model's own chat template where it has one
    return await serve(gs, request, body, [policy.render_chat(body.messages, end)], chat=True, tl=tl,
                       turns=policy.chat_turns(body.messages), chat_end=end, template_kwargs=extra)


async def serve(gs: GatewayState, request: Request, body: CompletionBody | ChatBody, prompts: list[str],
                chat: bool, tl: tools.Tools | None = None, turns: list[ChatTurn] | None = None,
                chat_end: str = "open", template_kwargs: dict | None = None) -> Response:
    """Validate, admit and run the prompts; a stream keeps the in-flight slot until it ends."""
    s = gs.settings
    chars = sum(len(p) for p in prompts)
    if chars > s.max_prompt_chars:
        raise policy.InvalidRequest(f"prompt is {chars} characters; the limit is {s.max_prompt_chars}", "prompt")
    params = policy.sampling_params(body, default_max_tokens=s.default_max_tokens,
                                    max_tokens_limit=s.max_tokens_limit, max_n=s.max_n)
    params = logprobs.apply(params, body, chat)
    params = _constrain(params, body, tl)
    render = logprobs.Renderer.of(body, params, chat)
    adm = await admit(gs, body.model, adapter=body.adapter)
    engine = adm.deployment.engine
    if engine not in compat.ENDPOINTS["chat"][1] and engine in compat.ENGINES:
        raise policy.InvalidRequest(f"'{adm.deployment.id}' is an embedding model (engine {engine}); it serves "
                                    "/v1/embeddings, not completions", "model")
    headers = compat.ignored_header(compat.check("chat" if chat else "completions", body, engine))
    batch_id = "cmpl-" + uuid.uuid4().hex[:24] if len(prompts) > 1 else ""  # one prompt: the run's own id
    thinking = adm.deployment.reasoning_parser if chat else ""  # (reasoning.py) split off, a constraint after it
    params = reasoning.gate(params, thinking, body.thinking_token_budget if chat else None)
    params = tools.keep_markers(params, tl, engine)
    runs = [RequestRun(gs=gs, deployment=adm.deployment, prompt=p, params=params, stream=bool(body.stream),
                       adapter=adm.adapter, priority=body.priority, chat=turns, chat_end=chat_end,
                       tools=tl.definitions() if tl is not None else None, template_kwargs=template_kwargs,
                       cache_key=body.prompt_cache_key or "",
                       **({"request_id": f"{batch_id}-{i}"} if batch_id else {}))
            for i, p in enumerate(prompts)]
    rid = batch_id or runs[0].request_id
    span = adm.begin("gateway " + ("chat" if chat else "completion"), request.headers)
    span.set_attribute("polyserve.request_id", rid)
    handed_off = False
    try:
        with trace.use_span(span, end_on_exit=False):  # one context switch for both phases
            await _start(runs)
            if body.stream:
                handed_off = True
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                headers.update(_sim_header(adm.deployment.engine == "sim") or {})
                shapers = [s for s in (
                    reasoning.ReasoningStream(thinking, include=body.include_reasoning is not False)
                    if thinking else None,
                    tools.ToolStream(tl) if tl is not None and tl.listed else None) if s is not None]
                return disconnect.EventStream(_stream(adm, runs, rid, chat, include_usage, render, shapers), request,
                                              headers=headers)
            out = await _collect(request, runs)
        headers.update(_sim_header(out.simulated) or {})
        answer = policy.full_response(
            chat=chat, request_id=rid, model=adm.deployment.id, texts=out.texts, finish=out.finish,
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens, simulated=out.simulated,
            cached_tokens=out.cached_tokens)
        if render.active:
            for i, choice in enumerate(answer["choices"]):
                render.choice(choice, i, out.prompts[i], out.logprobs[i], out.prompt_logprobs[i])
        if params.return_token_ids:
            policy.whole_token_ids(answer, chat, out.token_ids, out.prompt_token_ids)
        if body.prompt_logprobs is not None:
            logprobs.whole_prompt_logprobs(answer, chat, out.prompt_logprobs)
        for choice in answer["choices"] if thinking else ():  # the thinking apart, before tools read the content
            reasoning.render_message(choice, thinking, include=body.include_reasoning is not False)
        if tl is not None and tl.listed:
            for choice in answer["choices"]:
                tools.render_message(choice, tl)
        return Response(_json(answer), media_type="application/json", headers=headers)
    except GatewayError as exc:
        adm.failed(exc)
        raise
    finally:
        if not handed_off:
            adm.end()


async def _start(runs: list[RequestRun]) -> None:
    """Start every run (predict, dispatch, hand to a worker); if one fails, cancel the others."""
    if len(runs) == 1:  # the common case, in this task: a task of its own is a loop turn on the request's path
        await runs[0].start()
        return
    results = await asyncio.gather(*(r.start() for r in runs), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for run, res in zip(runs, results):
            if not isinstance(res, BaseException):
                await run.cancel("another prompt of the batch failed")
        raise failure


async def _collect(request: Request, runs: list[RequestRun]) -> Outcome:
    """Collect the non-streamed answers; a client that goes away, or one failed prompt of a batch,
    cancels the rest at their workers."""
    if len(runs) == 1:
        return merge([await disconnect.collect(request, runs[0])])
    tasks = [asyncio.ensure_future(r.collect()) for r in runs]

    async def all_or_first_failure() -> None:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()

    try:
        try:
            await disconnect.watched(request, all_or_first_failure())  # the client's departure probed
        except disconnect.ClientGone:
            raise GatewayError(499, "client disconnected") from None
        return merge([t.result() for t in tasks])
    except BaseException as exc:
        reason = "client disconnected" if isinstance(exc, GatewayError) and exc.status == 499 else \
            "another prompt of the batch failed"
        for task, run in zip(tasks, runs):
            if not task.done():
                task.cancel()
                await run.cancel(reason)
        raise


async def _chunks(runs: list[RequestRun]) -> AsyncIterator[tuple[int, TokenChunk]]:
    """(prompt index, chunk) of every run, as they come; a failure of one run ends it all."""
    if len(runs) == 1:
        async for chunk in runs[0].chunks():
            yield 0, chunk
        return
    # Bounded, so a slow client holds every run of the batch (their credit windows) rather than
    # this queue growing without limit.
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(runs))

    async def pump(i: int, run: RequestRun) -> None:
        try:
            async for chunk in run.chunks():
                await queue.put((i, chunk, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, None, exc))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        open_runs = len(runs)
        while open_runs:
            i, chunk, exc = await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                open_runs -= 1
                continue
            yield i, chunk
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()  # RequestRun.chunks() cancels its request at the worker
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(adm: Admission, runs: list[RequestRun], rid: str, chat: bool, include_usage: bool,
                  render: logprobs.Renderer, shapers: list | None = None):
    """The SSE body; an error after the first byte goes out as an error chunk.

    Events that are ready together go out in one write: while the next chunk is already in the
    run's inbox (a burst of tokens, or a client that reads more slowly than they come), the
    events wait for it, and leave together once the inbox is empty. Nothing waits for a chunk
    that has not come; each HTTP write costs the middleware chain and a syscall (issue 15)."""
    firsts: set[int] = set()
    model = runs[0].deployment.id
    n = runs[0].params.n
    usage = [0, 0, 0]  # prompt, completion, cached prompt tokens
    out: list[bytes] = []  # SSE events not written yet
    more = runs[0].has_next if len(runs) == 1 else (lambda: False)
    try:
        with trace.use_span(adm.span, end_on_exit=False):
            async for i, chunk in _chunks(runs):
                if chunk.done:
                    if chunk.stats:
                        usage[0] += chunk.stats.input_tokens
                        usage[1] += chunk.stats.output_tokens
                        usage[2] += chunk.stats.cached_tokens
                    continue  # chunks() ends after the done chunk
                if chunk.text or chunk.finish_reason or chunk.logprobs or chunk.token_ids:
                    index = i * n + chunk.index
                    body = policy.stream_chunk(chat=chat, request_id=rid, model=model, index=index,
                                               text=chunk.text, finish_reason=chunk.finish_reason,
                                               first=index not in firsts, simulated=chunk.simulated)
                    if render.active:
                        render.choice(body["choices"][0], index, runs[i].prompt, chunk.logprobs,
                                      chunk.prompt_logprobs)
                    if chunk.token_ids is not None:
                        policy.chunk_token_ids(body, chat, chunk.token_ids, chunk.prompt_token_ids)
                    bodies = [body]
                    for shaper in shapers or ():  # the reasoning apart, then tool calls (`feed` of each)
                        bodies = [b for x in bodies for b in shaper.feed(x)]
                    out += [_sse(b) for b in bodies]
                    firsts.add(index)
                if out and not more():
                    yield b"".join(out)
                    out.clear()
        if include_usage:
            out.append(_sse(policy.usage_chunk(chat=chat, request_id=rid, model=model, prompt_tokens=usage[0],
                                               completion_tokens=usage[1], cached_tokens=usage[2])))
        yield b"".join([*out, b"data: [DONE]\n\n"])
    except GatewayError as exc:
        adm.failed(exc)
        yield b"".join([*out, _sse(policy.error_body(exc.message, policy.error_type(exc.status),
                                                        code=str(exc.status)))])
    finally:
        adm.end()


def _constrain(params: SamplingParams, body: CompletionBody | ChatBody, tl: tools.Tools | None) -> SamplingParams:
    """`params` with the body's structured-output constraint, or a forced tool call's (tools.py)."""
    spec = tools.structured(body)
    forced = tl.constraint() if tl is not None else None
    if spec is not None and forced is not None:
        raise policy.InvalidRequest("a forced tool call (tool_choice) cannot be combined with "
                                    "response_format or structured_outputs", "tool_choice")
    spec = spec or forced
    return params if spec is None else msgspec.structs.replace(params, structured=spec)


_encoder = msgspec.json.Encoder()


def _json(obj: Any) -> bytes:
    """`obj` as compact JSON. msgspec is several times faster than json.dumps on the hot path
    (one call per SSE chunk); json.dumps is the fallback for what msgspec refuses (a string
    with a lone surrogate, which json.dumps escapes)."""
    try:
        return _encoder.encode(obj)
    except (TypeError, UnicodeEncodeError):
        return json.dumps(obj, separators=(",", ":")).encode()


def _sse(obj: Any) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


def _sim_header(simulated: bool | None) -> dict[str, str] | None:
    return {"X-Polyserve-Simulated": "true"} if simulated else None
