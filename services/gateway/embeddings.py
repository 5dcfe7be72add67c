"""OpenAI-compatible `POST /v1/embeddings`, served by encoder workers (Arlo polymorphing).

Path of one request: validate -> `admit()` (admission.py, shared with completions)
-> tokenize here (the gateway must know each input's length to dispatch it) -> for
every input, in parallel: `place()` (the deployment's policy, e.g. `arlo_mlq`, picks
a runtime instance for that length) -> `embed` on that worker -> gather the vectors
in input order. Each input is one dispatched
unit with its own request id (`<id>-<index>`) and exactly one `completed` or
`failed` event, so the dispatcher's outstanding counts stay exact.

Bad input (all 400, OpenAI error body, nothing else disturbed): empty input or
an empty item, more than `max_embedding_inputs` items, token ids outside the
vocabulary, an input longer than the largest runtime of the deployment (the
message says the limit) unless `truncate: true` cuts it to that limit.
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field

from polyserve.proto import (
    Admitted,
    Completed,
    Deployment,
    DispatchRequest,
    EmbedReply,
    EmbedRequest,
    Failed,
    Heartbeat,
    Placement,
)
from polyserve.shared.bus import BusError

from . import compat
from .admission import admit, place
from .context import Gateway, GatewayState
from .errors import GatewayError, status_of
from .policy import InvalidRequest

DEFAULT_MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODER_ENGINE = "encoder"


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = False  # extension: cut inputs longer than the largest runtime instead of a 400
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: -1 = the largest runtime, k = k tokens


def _as_items(body: EmbeddingBody) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, None) or (None, token arrays); InvalidRequest for empty input."""
    x = body.input
    if isinstance(x, str):
        x = [x]
    if not x:
        raise InvalidRequest("input must not be empty: send a string, a list of strings or token arrays",
                             "input")
    if isinstance(x[0], str):
        for i, t in enumerate(x):
            if not t:
                raise InvalidRequest(f"input[{i}] is an empty string; every input needs text", "input")
        return list(x), None
    if isinstance(x[0], int):
        x = [x]
    for i, ids in enumerate(x):
        if not ids:
            raise InvalidRequest(f"input[{i}] is an empty token array", "input")
    return None, [list(ids) for ids in x]


def _vector(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


class EmbedRun:
    """One /v1/embeddings request: every input dispatched and embedded on its own."""

    def __init__(self, gs: GatewayState, dep: Deployment, rows: list[list[int]]):
        self.gs = gs
        self.dep = dep
        self.rows = rows
        self.request_id = "embd-" + uuid.uuid4().hex[:24]
        self.t0 = time.monotonic()

    async def run(self) -> list[EmbedReply]:
        results = await asyncio.gather(*(self._one(i, r) for i, r in enumerate(self.rows)),
                                       return_exceptions=True)
        for r in results:  # the first failure answers the client; the others ended on their own
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def _one(self, index: int, ids: list[int]) -> EmbedReply:
        """Place and embed one input; publishes its `admitted` and its one terminal event.
        A worker that went away (503) before it took the input is excluded and the input
        placed again."""
        gs, dep, s = self.gs, self.dep, self.gs.settings
        rid = f"{self.request_id}-{index}"
        base = {"request_id": rid, "deployment": dep.id, "model": dep.model}
        t0 = time.monotonic()
        await gs.event("admitted", Admitted(**base, input_tokens=len(ids), max_tokens=0))
        placement: Placement | None = None
        try:
            excluded: list[str] = []
            for attempt in range(s.dispatch_retries + 1):
                placement = await place(gs, DispatchRequest(request_id=rid, deployment=dep.id, model=dep.model,
                                                            input_tokens=len(ids), exclude=excluded), base)
                try:
                    reply = await gs.bus.request(
                        gs.subjects.embed(placement.worker_id),
                        EmbedRequest(request_id=rid, deployment=dep.id, model=dep.model, input_ids=[ids]),
                        EmbedReply, timeout=s.first_token_timeout_s, span_name="embed")
                    break
                except BusError as exc:
                    if exc.code == 503 and attempt < s.dispatch_retries:
                        excluded.append(placement.worker_id)
                        continue
                    raise status_of(exc, f"worker {placement.worker_id}") from exc
        except BaseException as exc:
            status, reason = (exc.status, exc.message) if isinstance(exc, GatewayError) else (500, "gateway error")
            await gs.event("failed", Failed(**base, reason=reason, status=status,
                                            worker_id=placement.worker_id if placement else "",
                                            e2e_ms=(time.monotonic() - t0) * 1e3))
            raise
        e2e = (time.monotonic() - t0) * 1e3
        await gs.event("completed", Completed(**base, worker_id=reply.worker_id, input_tokens=sum(reply.tokens),
                                              output_tokens=0, e2e_ms=e2e, ttft_ms=e2e, queue_ms=reply.queue_ms,
                                              finish_reason="stop", simulated=reply.simulated))
        return reply


def add_embedding_routes(app: FastAPI) -> None:
    """Add `POST /v1/embeddings` to the gateway's app (build_app does)."""
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])


async def embeddings(body: EmbeddingBody, request: Request, gs: Gateway) -> JSONResponse:
    """Validate, admit, tokenize, then embed every input on the runtime that fits it."""
    texts, arrays = _as_items(body)
    _check_size(gs, texts, arrays)
    adm = await admit(gs, body.model)
    dep = adm.deployment
    unknown = compat.check("embeddings", body, dep.engine)
    cut = body.truncate_prompt_tokens
    if cut == 0:
        raise InvalidRequest("truncate_prompt_tokens must be -1 (the largest runtime) or a number of tokens",
                             "truncate_prompt_tokens")
    encoders = await _encoders(gs, dep)
    rows, dim = await _tokenized(dep, encoders, texts, arrays, -1 if body.truncate and cut is None else cut)
    if body.dimensions is not None and body.dimensions != dim:
        raise InvalidRequest(f"'{dep.id}' embeds into {dim} dimensions; it cannot produce "
                             f"{body.dimensions}", "dimensions")
    run = EmbedRun(gs, dep, rows)
    span = adm.begin("gateway embeddings", request.headers)
    span.set_attribute("polyserve.request_id", run.request_id)
    span.set_attribute("polyserve.inputs", len(rows))
    try:
        with trace.use_span(span, end_on_exit=False):
            replies = await run.run()
    except GatewayError as exc:
        adm.failed(exc)
        gs.metrics.finished(dep.id, exc.status)
        raise
    except Exception:
        gs.metrics.finished(dep.id, 500)
        raise
    finally:
        adm.end()
    gs.metrics.finished(dep.id, 200, time.monotonic() - run.t0)
    return _response(dep, replies, body.encoding_format, compat.ignored_header(unknown))


def _check_size(gs: GatewayState, texts: list[str] | None, arrays: list[list[int]] | None) -> None:
    s = gs.settings
    n = len(texts or arrays)
    max_inputs = int(getattr(s, "max_embedding_inputs", DEFAULT_MAX_INPUTS))
    if n > max_inputs:
        raise InvalidRequest(f"{n} inputs in one request; the limit is {max_inputs}: split it", "input")
    if texts and sum(len(t) for t in texts) > s.max_prompt_chars:
        raise InvalidRequest(f"input totals {sum(len(t) for t in texts)} characters; the limit is "
                             f"{s.max_prompt_chars}", "input")


async def _encoders(gs: GatewayState, dep: Deployment) -> list[Heartbeat]:
    """The live encoder workers of `dep`: 400 when it is no embedding model, 503 when none runs."""
    workers = await gs.live_workers(dep.id)
    encoders = [hb for hb in workers if hb.engine == ENCODER_ENGINE]
    if (workers and not encoders) or (not workers and dep.engine != ENCODER_ENGINE):
        raise InvalidRequest(f"'{dep.id}' is not an embedding model (engine {dep.engine}); deploy an "
                             f"encoder (engine '{ENCODER_ENGINE}') for /v1/embeddings", "model")
    if not encoders:
        raise GatewayError(503, f"no encoder worker is running for '{dep.id}'; start one and retry",
                           retry_after=1)
    return encoders


async def _tokenized(dep: Deployment, encoders: list[Heartbeat], texts: list[str] | None,
                     arrays: list[list[int]] | None, cut: int | None) -> tuple[list[list[int]], int]:
    """(token rows with special tokens, embedding dimension); every row fits the largest runtime
    of `dep`: `cut` -1 cuts rows to it, `cut` k to k tokens, else an over-long input is a 400
    saying the limit."""
    from polyserve.core.encoder_text import EncoderNotFound, load_text_tokenizer, model_dir_for, truncate_ids

    try:
        tok = await asyncio.to_thread(load_text_tokenizer, str(model_dir_for(dep.model)))
    except EncoderNotFound as exc:
        raise GatewayError(500, f"no tokenizer for '{dep.id}': {exc}") from exc
    if texts is not None:  # big batches tokenize off the event loop
        big = len(texts) > 32 or sum(len(t) for t in texts) > 20_000
        rows = await asyncio.to_thread(tok.encode, texts) if big else tok.encode(texts)
    else:
        for i, ids in enumerate(arrays):
            bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"input[{i}] has token id {bad}, outside the vocabulary "
                                     f"(0..{tok.vocab_size - 1})", "input")
        rows = [tok.wrap(ids) for ids in arrays]
    limit = max(hb.max_input_len if hb.max_input_len > 0 else tok.max_positions for hb in encoders)
    limit = min(limit, tok.max_positions)
    if cut is not None and cut > 0:
        rows = [truncate_ids(r, min(cut, limit), tok.sep_id) for r in rows]
    for i, r in enumerate(rows):
        if len(r) > limit:
            if cut is None:
                raise InvalidRequest(f"input[{i}] is {len(r)} tokens; the largest runtime of '{dep.id}' "
                                     f"takes at most {limit} tokens (special tokens included). Shorten it, "
                                     f"or send \"truncate\": true to cut inputs to {limit}", "input",
                                     code="input_too_long")
            rows[i] = truncate_ids(r, limit, tok.sep_id)
    return rows, tok.dim


def _response(dep: Deployment, replies: list[EmbedReply], encoding_format: str,
              headers: dict[str, str]) -> JSONResponse:
    tokens = sum(sum(r.tokens) for r in replies)
    simulated = any(r.simulated for r in replies)
    out = {"object": "list", "model": dep.id,
           "data": [{"object": "embedding", "index": i, "embedding": _vector(r.embeddings[0], encoding_format)}
                    for i, r in enumerate(replies)],
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    headers = {**headers, "X-Polyserve-Runtimes": ",".join(sorted({r.runtime for r in replies}))}
    if simulated:
        out["simulated"] = True
        headers["X-Polyserve-Simulated"] = "true"
    return JSONResponse(out, headers=headers)
