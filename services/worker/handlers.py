"""The worker's NATS handlers: generate (admit, reply, stream TokenChunks) and cancel.

Streaming protocol, which the gateway relies on:

1. The generate request is answered at once: `GenerateAccepted`, or an error
   reply (429 when the engine's queue is full, the engine's status otherwise).
2. Tokens then go to `req.stream_to` as `TokenChunk`s with `seq` 0, 1, 2, ...;
   a choice's last chunk carries its `finish_reason`.
3. The last chunk has `done=True` with the request's `stats`, or `error` when
   the engine failed or the worker shut down mid-stream. Every chunk says
   whether it is `simulated`.
4. Every chunk sent is kept in the stream's `Outbox` (outbox.py) until the gateway
   acknowledges it (`Credit`), so a lost one can be sent again (`ReplayRequest` on
   the worker's replay subject). With `req.window` > 0 at most that many chunks are
   unacknowledged: a client that reads slowly holds its stream here (bounded), and
   one that reads nothing for `slow_reader_limit_s` gets an explicit error.
5. A non-streamed request (`req.stream` False) gets fewer, merged chunks (merge.py); with
   `req.last_on_done` and one choice its last delta rides on the done chunk.
6. `req.resume` (request migration): the stream continues what another worker
   started; the engine generates on from prompt + that output.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec
from opentelemetry import trace

from polyserve.proto import (
    CHAT_ENDS,
    WORKER_SHUTDOWN,
    AdapterCommand,
    CancelRequest,
    Credit,
    GenerateAccepted,
    GenerateRequest,
    Placement,
    ReplayReply,
    ReplayRequest,
    RequestStats,
    SamplingParams,
    TokenChunk,
    Withdraw,
    WithdrawReply,
    chat_transcript,
)
from polyserve.shared.bus import Bus, BusError, encode
from polyserve.worker.engine import Delta, Engine, EngineError, EngineOverloaded, EngineRequest, Finished, Withdrawn
from polyserve.worker.merge import Merger
from polyserve.worker.outbox import Outbox

logger = logging.getLogger(__name__)

SHUTDOWN = WORKER_SHUTDOWN
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
    if req.chat_end not in CHAT_ENDS:
        problems.append(f"chat_end must be one of {', '.join(CHAT_ENDS)} (got {req.chat_end!r})")
    elif req.chat_end == "continue" and (not req.chat or req.chat[-1].role != "assistant"):
        problems.append("chat_end 'continue' needs a chat whose last message is the assistant's")
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


def _chunk(req: GenerateRequest, seq: int, d: Delta, simulated: bool) -> TokenChunk:
    return TokenChunk(request_id=req.request_id, seq=seq, index=d.index, text=d.text, tokens=d.tokens,
                      finish_reason=d.finish_reason, simulated=simulated, logprobs=d.logprobs,
                      prompt_logprobs=d.prompt_logprobs, token_ids=d.token_ids, prompt_token_ids=d.prompt_token_ids)


class SlowReader(EngineError):
    """No credit came for a held stream: its client has read nothing for the limit."""


def resumed_params(req: GenerateRequest) -> SamplingParams:
    """The sampling parameters of a migrated stream: what is left of the token budget."""
    p, done = req.params, req.resume.tokens
    return msgspec.structs.replace(p, max_tokens=p.max_tokens - done, min_tokens=max(0, p.min_tokens - done),
                                   prompt_logprobs=None)


def check_resume(req: GenerateRequest, engine: Engine) -> None:
    """Raise BusError saying why this worker cannot continue the migrated stream `req`."""
    r, p = req.resume, req.params
    if not engine.resumable:
        raise BusError(501, f"the {engine.name} engine cannot continue a started stream (request migration)")
    if p.n != 1 or p.structured is not None or p.return_token_ids:
        raise BusError(400, "only a stream with n = 1, no structured output and no token ids can be continued "
                            "elsewhere")
    if r.tokens < 0 or r.tokens >= p.max_tokens:
        raise BusError(400, f"resume.tokens must be between 0 and max_tokens - 1 (got {r.tokens})")


class WorkerHandlers:
    """Generate and cancel for one engine; streams run in tasks kept in a set."""

    def __init__(self, engine: Engine, bus: Bus, tracer: trace.Tracer, worker_id: str, *,
                 replay_chunks: int = 1024, replay_linger_s: float = 5.0, slow_reader_limit_s: float = 30.0,
                 merge_ms: float = 0.0):
        self.merge_s = merge_ms / 1e3  # a non-streamed request's chunks are merged this long (merge.py)
        self.replay_chunks = replay_chunks  # replay buffer of a stream without a credit window
        self.replay_linger_s = replay_linger_s  # how long an ended stream's chunks stay unacknowledged
        self.slow_reader_limit_s = slow_reader_limit_s  # a held stream with no credit this long: error
        self.outboxes: dict[str, Outbox] = {}
        self.migrated_in = 0  # streams this worker continued for another (request migration)
        self.replays = 0  # replay requests answered with chunks
        self.holds = 0  # times a stream waited for credit (slow readers)
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
        try:
            base, messages = self._prompt(req)
        except EngineError as exc:
            raise BusError(exc.status, str(exc)) from exc
        prompt, params, cont = base, req.params, ""
        if req.resume is not None:
            check_resume(req, self.engine)
            prompt, params, cont = base + req.resume.text, resumed_params(req), req.resume.text
        ereq = EngineRequest(request_id=req.request_id, prompt=prompt, params=params,
                             adapter=req.adapter, priority=req.priority,
                             predicted_tokens=max(0, req.predicted_tokens - (req.resume.tokens if cont else 0)),
                             length_class=req.length_class, continuation=cont, tenant=req.tenant,
                             messages=messages, chat_end=req.chat_end, tools=req.tools if messages else None,
                             template_kwargs=req.template_kwargs or None)
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
        box = self.outboxes[req.request_id] = Outbox(req.window, self.replay_chunks)
        if req.resume is not None:
            self.migrated_in += 1
            logger.info("worker %s continues %s after %d token(s) streamed elsewhere (migration %d)",
                        self.worker_id, req.request_id, req.resume.tokens, req.resume.migrations)
        task = asyncio.create_task(self._stream(req, stream, first, box, base), name=f"stream:{req.request_id}")
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)
        return GenerateAccepted(request_id=req.request_id, worker_id=self.worker_id,
                                queue_position=max(0, self.engine.load().waiting - 1), replay=True,
                                resumable=self.engine.resumable, window=box.window)

    async def replay(self, req: ReplayRequest) -> ReplayReply:
        """Send back the buffered chunks of a stream (a gap the gateway saw, or its liveness probe)."""
        box = self.outboxes.get(req.request_id)
        if box is None:
            return ReplayReply(request_id=req.request_id, worker_id=self.worker_id, known=False)
        chunks = box.replay(req.from_seq, req.to_seq)
        if chunks:
            self.replays += 1
            logger.info("worker %s re-sends %d chunk(s) of %s from seq %d", self.worker_id, len(chunks),
                        req.request_id, req.from_seq)
        return ReplayReply(request_id=req.request_id, worker_id=self.worker_id, known=True, chunks=chunks,
                           first_seq=box.first_seq)

    async def credit(self, c: Credit) -> None:
        """The gateway relayed chunks up to `c.acked`: open the window; forget a finished stream."""
        box = self.outboxes.get(c.request_id)
        if box is not None:
            box.ack(c.acked)
            if box.finished:
                self.outboxes.pop(c.request_id, None)

    def _linger(self, request_id: str, box: Outbox) -> None:
        """Keep an ended stream's chunks for replay until acknowledged, at most `replay_linger_s`."""
        def forget() -> None:
            if self.outboxes.get(request_id) is box:
                del self.outboxes[request_id]

        if box.finished:
            forget()
        else:
            asyncio.get_running_loop().call_later(self.replay_linger_s, forget)

    async def _send(self, req: GenerateRequest, box: Outbox, chunk: TokenChunk) -> None:
        """Publish one chunk within the credit window (the last chunk of a stream always goes)."""
        if box.window and chunk.seq - box.acked > box.window:
            self.holds += 1  # the client reads more slowly than the engine writes: hold the stream
        if not chunk.done and not await box.wait_credit(chunk.seq, self.slow_reader_limit_s):
            raise SlowReader(f"the client read nothing for {self.slow_reader_limit_s:.0f}s "
                             f"(slow_reader_limit_s); the stream was stopped, not cut short silently", 504)
        box.add(chunk)
        # A plain PUB, no trace headers: nobody reads a chunk's trace context (the request's
        # spans hang off the generate request), and per chunk the headers cost the worker an
        # OpenTelemetry inject and the gateway a header parse; together ~15% of the worker's and
        # ~6% of the gateway's CPU per 16-token request (cProfile; docs/benchmarks/overhead.md).
        await self.bus.nc.publish(req.stream_to, encode(chunk))

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

    def _prompt(self, req: GenerateRequest) -> tuple[str, list[dict] | None]:
        """What the engine runs: a chat's messages through the model's own chat template when it
        has one (`Engine.chat_prompt`), else the gateway's prompt (its transcript of a chat, which
        lists a tool chat's tools and calls) with the messages beside it (`EngineRequest.messages`,
        the tools in `EngineRequest.tools`)."""
        if req.chat is None:
            return req.prompt, None
        messages = [t.message() for t in req.chat]
        templated = self.engine.chat_prompt(messages, req.chat_end, req.tools, req.template_kwargs or None)
        if templated is not None:
            return templated, None
        # a long chat comes without its transcript (a tool chat never: the gateway's lists the tools)
        return req.prompt or chat_transcript(req.chat, req.chat_end), messages

    async def _stream(self, req: GenerateRequest, stream: AsyncIterator, first: asyncio.Future,
                      box: Outbox, prompt: str) -> None:
        simulated = self.engine.simulated
        seq, tokens = 0, 0
        reasons: dict[int, str] = {}
        stats: RequestStats | None = None
        error: str | None = None
        last: Delta | None = None  # the final delta, sent on the done chunk (`hold_last`)
        # no span at all when this worker's tracer records none (as Bus.serve: issue 15)
        spanned = self.tracer.start_as_current_span("worker generate") if self.bus.records_spans else \
            contextlib.nullcontext(trace.INVALID_SPAN)
        with spanned as span:
            span.set_attribute("polyserve.request_id", req.request_id)
            span.set_attribute("polyserve.worker_id", self.worker_id)
            span.set_attribute("polyserve.simulated", simulated)
            try:
                async with contextlib.aclosing(stream):
                    # a single-choice, non-streamed request's last delta rides on the done chunk
                    # when its gateway takes it there (merge.py `hold_last`)
                    merger = Merger(0.0 if req.stream else self.merge_s,
                                    hold_last=req.last_on_done and not req.stream and req.params.n == 1)
                    ev = await first
                    while not isinstance(ev, Finished):
                        if isinstance(ev, Delta):
                            tokens += ev.tokens
                            if ev.finish_reason:
                                reasons[ev.index] = ev.finish_reason
                            for d in merger.add(ev):
                                await self._send(req, box, _chunk(req, seq, d, simulated))
                                seq += 1
                        ev = await stream.__anext__()
                    tail = merger.flush()
                    if merger.hold_last and tail:
                        last = tail.pop()
                    for d in tail:
                        await self._send(req, box, _chunk(req, seq, d, simulated))
                        seq += 1
                    stats = self._whole(req, ev.stats, prompt)
            except Withdrawn:
                target = self._redirects.pop(req.request_id, None)
                if target is not None:
                    self.withdrawn += 1
                    span.set_attribute("polyserve.moved_to", target.worker_id)
                    try:
                        await self._send(req, box, TokenChunk(request_id=req.request_id, seq=seq, done=False,
                                                              redirect=target, simulated=simulated))
                    except Exception:
                        logger.exception("cannot send the redirect of %s", req.request_id)
                    self._linger(req.request_id, box)
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
            if last is not None and error is None:
                done = msgspec.structs.replace(_chunk(req, seq, last, simulated), done=True,
                                               finish_reason=done.finish_reason, stats=stats)
            span.set_attribute("polyserve.output_tokens", tokens)
            if error:
                self.failed += 1
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            else:
                self.completed += 1
            try:
                await self._send(req, box, done)
            except Exception:
                logger.exception("cannot send the final chunk of %s", req.request_id)
            self._linger(req.request_id, box)

    def _whole(self, req: GenerateRequest, stats: RequestStats, prompt: str) -> RequestStats:
        """A migrated stream's usage as the client sees it: its own prompt and the whole output."""
        if req.resume is None:
            return stats
        return msgspec.structs.replace(stats, input_tokens=self.engine.count_tokens(prompt),
                                       output_tokens=stats.output_tokens + req.resume.tokens)

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
