"""The worker's `<prefix>.v1.worker.<id>.embed` handler: EmbedRequest -> EmbedReply.

Registered by the worker service when its engine embeds (the `encoder` engine);
`serve_embeddings(service)` is a no-op for other engines. Errors are replies with
error headers: 400 a bad input (too long without `truncate`, empty), 429 the
runtime's queue is full, 503 the worker is shutting down.
"""
from __future__ import annotations

import logging
from typing import Any

from polyserve.proto import EmbedReply, EmbedRequest
from polyserve.shared.bus import BusError
from polyserve.worker.engine import EngineError, EngineOverloaded

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # per request; the gateway enforces its own (lower) limit first


class EmbedHandler:
    """Validates an EmbedRequest, runs it on the engine, builds the reply."""

    def __init__(self, engine: Any, worker_id: str):
        self.engine = engine
        self.worker_id = worker_id
        self.closing = False
        self.served = 0
        self.failed = 0

    async def embed(self, req: EmbedRequest) -> EmbedReply:
        if self.closing:
            raise BusError(503, f"worker {self.worker_id} is shutting down; dispatch elsewhere")
        if req.inputs and req.input_ids:
            raise BusError(400, "send either inputs (text) or input_ids, not both")
        n = len(req.input_ids) or len(req.inputs)
        if n == 0:
            raise BusError(400, "no input to embed: inputs and input_ids are both empty")
        if n > MAX_INPUTS:
            raise BusError(400, f"{n} inputs in one request; the limit is {MAX_INPUTS}")
        rows = req.input_ids or self.engine.tokenize(req.inputs)
        try:
            res = await self.engine.embed(req.request_id, rows, truncate=req.truncate)
        except EngineOverloaded as exc:
            self.failed += 1
            raise BusError(429, str(exc)) from exc
        except EngineError as exc:
            self.failed += 1
            raise BusError(exc.status, str(exc)) from exc
        self.served += 1
        return EmbedReply(request_id=req.request_id, worker_id=self.worker_id, embeddings=res.embeddings,
                          tokens=res.tokens, max_length=0 if self.engine.cfg.shape == "dynamic"
                          else self.engine.max_length, batch_size=self.engine.cfg.batch_size,
                          runtime=self.engine.runtime_name, truncated=res.truncated, queue_ms=res.queue_ms,
                          compute_ms=res.compute_ms, simulated=self.engine.simulated)


async def serve_embeddings(service: Any) -> EmbedHandler | None:
    """Answer `embed` for the service's worker when its engine embeds; None otherwise.

    Call in the worker's on_start after the engine started and before the flush
    that precedes WorkerUp, so nobody is told about a subject nobody answers."""
    engine = service.engine
    if engine is None or not callable(getattr(engine, "embed", None)):
        return None
    handler = EmbedHandler(engine, service.worker_id)
    await service.bus.serve(service.subjects.embed(service.worker_id), EmbedRequest, handler.embed)
    return handler
