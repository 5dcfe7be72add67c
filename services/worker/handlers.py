"""The worker's NATS handlers: generate (admit, reply, stream TokenChunks) and cancel.

Streaming protocol, which the gateway relies on:

1. The generate request is answered at once: `GenerateAccepted`, or an error
   reply (429 when the engine's queue is full, the engine's status otherwise).
2. Tokens then go to `req.stream_to` as `TokenChunk`s with `seq` 0, 1, 2, ...;
   a choice's last chunk carries its `finish_reason`.
3. The last chunk has `done=True` with the request's `stats`, or `error` when
   the engine failed or the worker shut down mid-stream. Every chunk says
   whether it is `simulated`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from opentelemetry import trace

from polyserve.proto import (
    AdapterCommand,
    CancelRequest,
    GenerateAccepted,
    GenerateRequest,
    Placement,
    RequestStats,
    TokenChunk,
    Withdraw,
    WithdrawReply,
)
from polyserve.shared.bus import Bus, BusError
from polyserve.worker.engine import Delta, Engine, EngineError, EngineOverloaded, EngineRequest, Finished, Withdrawn

logger = logging.getLogger(__name__)

SHUTDOWN = "worker shutting down"
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


def validate(req: GenerateRequest) -> None:
    """Raise BusError(400) saying what to fix in a request no engine could serve.

    `max_tokens` and `n` are not checked here: the gateway validates them at the edge
    and every engine on admission (`engine.check_request`, the sim engine's own
    check), whose 400 becomes the reply."""
    p = req.params
    problems = []
    if not req.stream_to:
        problems.append("stream_to must name the inbox the tokens go to")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        problems.append(f"min_tokens must be between 0 and max_tokens (got {p.min_tokens})")
    if p.temperature < 0:
        problems.append(f"temperature must be >= 0 (got {p.temperature})")
    if not 0 < p.top_p <= 1:
        problems.append(f"top_p must be in (0, 1] (got {p.top_p})")
    if p.top_k < 0:
        problems.append(f"top_k must be >= 0 (got {p.top_k})")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            problems.append(f"{name} must be between 0 and {MAX_LOGPROBS} (got {k})")
    if problems:
        raise BusError(400, "; ".join(problems))


def overall_finish_reason(reasons: dict[int, str]) -> str | None:
    """The done chunk's finish_reason: "cancelled" if any choice was, else the common reason."""
    values = set(reasons.values())
    if "cancelled" in values:
        return "cancelled"
    return values.pop() if len(values) == 1 else None


async def _next(stream: AsyncIterator):
    return await stream.__anext__()


class WorkerHandlers:
    """Generate and cancel for one engine; streams run in tasks kept in a set."""

    def __init__(self, engine: Engine, bus: Bus, tracer: trace.Tracer, worker_id: str):
        self.engine = engine
        self.bus = bus
        self.tracer = tracer
        self.worker_id = worker_id
        self.closing = False
        self.streams: set[asyncio.Task] = set()
        self.completed = 0
        self.failed = 0
        self._adapter_locks: dict[str, asyncio.Lock] = {}
        self._redirects: dict[str, Placement] = {}  # request_id -> where a withdrawn request goes
        self.withdrawn = 0

    async def ensure_adapter(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` unless loaded (one load at a time per name)."""
        lock = self._adapter_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if self.engine.has_adapter(name):
                return
            t = asyncio.get_running_loop().time()
            await self.engine.load_adapter(name, path)
            logger.info("worker %s loaded adapter %s from %s in %.0f ms", self.worker_id, name, path,
                        (asyncio.get_running_loop().time() - t) * 1e3)

    async def adapter_command(self, cmd: AdapterCommand) -> None:
        """Load or unload an adapter on the deployment's broadcast (admin API)."""
        try:
            if cmd.action == "load":
                await self.ensure_adapter(cmd.name, cmd.path)
            elif cmd.action == "unload" and self.engine.has_adapter(cmd.name):
                await self.engine.unload_adapter(cmd.name, force=True)
        except EngineError as exc:
            logger.error("worker %s: adapter %s %s failed: %s", self.worker_id, cmd.action, cmd.name, exc)

    async def generate(self, req: GenerateRequest) -> GenerateAccepted:
        """Admit into the engine (errors become the reply), then stream in a task."""
        if self.closing:
            raise BusError(503, f"worker {self.worker_id} is shutting down; dispatch elsewhere")
        validate(req)
        if req.adapter and req.adapter_path and not self.engine.has_adapter(req.adapter):
            try:  # a cold start: the request waits for the load (CaraServe hides this later)
                await self.ensure_adapter(req.adapter, req.adapter_path)
            except EngineError as exc:
                raise BusError(exc.status, f"adapter {req.adapter}: {exc}") from exc
        ereq = EngineRequest(request_id=req.request_id, prompt=req.prompt, params=req.params,
                             adapter=req.adapter, priority=req.priority,
                             predicted_tokens=req.predicted_tokens, length_class=req.length_class)
        try:
            # Engines admit either in the generate() call (sim) or, as async
            # generators, before the first suspension of their first __anext__;
            # one loop turn lets the latter raise here, in the reply.
            stream = self.engine.generate(ereq)
            first = asyncio.ensure_future(_next(stream))
            await asyncio.sleep(0)
            if first.done() and first.exception() is not None:
                first.result()
        except EngineOverloaded as exc:
            raise BusError(429, str(exc)) from exc
        except EngineError as exc:
            raise BusError(exc.status, str(exc)) from exc
        # Started in the server span's context, so "worker generate" is its child.
        task = asyncio.create_task(self._stream(req, stream, first), name=f"stream:{req.request_id}")
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)
        return GenerateAccepted(request_id=req.request_id, worker_id=self.worker_id,
                                queue_position=max(0, self.engine.load().waiting - 1))

    async def cancel(self, req: CancelRequest) -> GenerateAccepted:
        """Stop a request now; its stream ends with finish_reason "cancelled".

        The ack's queue_position is -1 when the request was unknown (already done)."""
        known = self.engine.cancel(req.request_id)
        logger.info("cancel %s (%s): %s", req.request_id, req.reason, "done" if known else "not in flight")
        return GenerateAccepted(request_id=req.request_id, worker_id=self.worker_id,
                                queue_position=0 if known else -1)

    async def withdraw(self, req: Withdraw) -> WithdrawReply:
        """Give back a request that has not started: its client is told (a TokenChunk with
        `redirect`) to send it to `req.placement`. A started or unknown one stays."""
        self._redirects[req.request_id] = req.placement
        ok = self.engine.withdraw(req.request_id)
        if not ok:
            self._redirects.pop(req.request_id, None)
        logger.info("withdraw %s to %s (%s): %s", req.request_id, req.placement.worker_id, req.reason,
                    "given back" if ok else "already started or unknown")
        return WithdrawReply(request_id=req.request_id, worker_id=self.worker_id, withdrawn=ok,
                             reason="" if ok else "started, finished or unknown on this worker")

    async def _stream(self, req: GenerateRequest, stream: AsyncIterator, first: asyncio.Future) -> None:
        simulated = self.engine.simulated
        seq, tokens = 0, 0
        reasons: dict[int, str] = {}
        stats: RequestStats | None = None
        error: str | None = None
        with self.tracer.start_as_current_span("worker generate") as span:
            span.set_attribute("polyserve.request_id", req.request_id)
            span.set_attribute("polyserve.worker_id", self.worker_id)
            span.set_attribute("polyserve.simulated", simulated)
            try:
                async with contextlib.aclosing(stream):
                    ev = await first
                    while not isinstance(ev, Finished):
                        if isinstance(ev, Delta):
                            await self.bus.publish(req.stream_to, TokenChunk(
                                request_id=req.request_id, seq=seq, index=ev.index, text=ev.text,
                                tokens=ev.tokens, finish_reason=ev.finish_reason, simulated=simulated,
                                logprobs=ev.logprobs, prompt_logprobs=ev.prompt_logprobs))
                            seq += 1
                            tokens += ev.tokens
                            if ev.finish_reason:
                                reasons[ev.index] = ev.finish_reason
                        ev = await stream.__anext__()
                    stats = ev.stats
            except Withdrawn:
                target = self._redirects.pop(req.request_id, None)
                if target is not None:
                    self.withdrawn += 1
                    span.set_attribute("polyserve.moved_to", target.worker_id)
                    try:
                        await self.bus.publish(req.stream_to, TokenChunk(request_id=req.request_id, seq=seq,
                                                                         redirect=target, simulated=simulated))
                    except Exception:
                        logger.exception("cannot send the redirect of %s", req.request_id)
                    return
                error = "withdrawn without a destination"
            except asyncio.CancelledError:
                error = SHUTDOWN if self.closing else "stream cancelled"
            except StopAsyncIteration:
                error = "engine ended the stream without a final event"
            except EngineError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - any engine fault must reach the client
                logger.exception("stream of %s failed", req.request_id)
                error = f"{type(exc).__name__}: {exc}"
            done = TokenChunk(request_id=req.request_id, seq=seq, done=True,
                              finish_reason=overall_finish_reason(reasons), error=error, stats=stats,
                              simulated=simulated)
            span.set_attribute("polyserve.output_tokens", tokens)
            if error:
                self.failed += 1
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            else:
                self.completed += 1
            try:
                await self.bus.publish(req.stream_to, done)
            except Exception:
                logger.exception("cannot send the final chunk of %s", req.request_id)

    async def drain(self, timeout: float) -> None:
        """Refuse new work; let streams finish within `timeout`, then cancel the rest,
        each of which ends with a final chunk whose error is "worker shutting down"."""
        self.closing = True
        if not self.streams:
            return
        grace = max(0.0, timeout - min(1.0, timeout * 0.2))  # keep time for the final chunks
        _, pending = await asyncio.wait(set(self.streams), timeout=grace)
        if pending:
            logger.warning("drain: cancelling %d unfinished streams", len(pending))
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=max(0.5, timeout - grace))
