"""One completion's path through the control plane after admission (admission.py):
predict -> dispatch -> generate on the worker -> relay chunks. Exactly one terminal
event (completed or failed) is published per admitted request, whatever happens."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from polyserve.proto import (
    INLINE_TRANSCRIPT_CHARS,
    AdapterSpec,
    Admitted,
    CancelRequest,
    ChatTurn,
    Completed,
    Deployment,
    Dispatched,
    DispatchRequest,
    Failed,
    FirstToken,
    GenerateAccepted,
    GenerateRequest,
    Placement,
    Prediction,
    PredictRequest,
    Resume,
    SamplingParams,
    TokenChunk,
)
from polyserve.shared.bus import BusError, decode, error_of

from . import admission, prefixes, routing, tenancy
from .context import GatewayState
from .delivery import Delivery, WorkerDied, next_message
from .errors import GatewayError, status_of
from .outcome import Outcome
from .policy import InvalidRequest, estimate_tokens

logger = logging.getLogger(__name__)


@dataclass
class RequestRun(Delivery):
    """State of one admitted completion; use `start()` then iterate `chunks()`. Lost chunks,
    dead workers and slow readers are handled by `Delivery` (delivery.py)."""

    gs: GatewayState
    deployment: Deployment
    prompt: str
    params: SamplingParams
    stream: bool
    adapter: AdapterSpec | None = None  # the LoRA adapter the request runs with
    priority: int = 0
    request_id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex[:24])
    t0: float = field(default_factory=time.monotonic)
    input_tokens: int = 0
    placement: Placement | None = None
    prediction: Prediction | None = None
    terminal: bool = False
    simulated: bool = False
    finish_reason: str = "stop"
    redirects: int = 0  # times a worker gave the request back before it started (Aladdin Alg. 2)
    _moved_ms: float = 0.0  # time spent queued on workers that gave it back
    _sent_at: float = 0.0
    _predicting: asyncio.Future | None = None  # the predictor's answer, when the request did not wait for it
    _inbox: str = ""
    _queue: asyncio.Queue | None = None
    _expect: int = 0  # the next chunk `seq` to relay (the worker numbers them 0, 1, 2, ...)
    _held: dict[int, TokenChunk] = field(default_factory=dict)  # chunks that came after a missing seq
    _gap_since: float = 0.0  # monotonic time the oldest missing seq was first missed
    migrations: int = 0  # times the request moved to another worker after its worker died
    _caps: GenerateAccepted | None = None  # what the current worker said it does (replay, resume, window)
    _dead: list[str] = field(default_factory=list)  # workers this request died on
    _out_text: dict[int, list[str]] = field(default_factory=dict)  # per choice: the text handed out, in pieces
    _out_tokens: dict[int, int] = field(default_factory=dict)  # per choice: its tokens
    _finished: set[int] = field(default_factory=set)  # choices whose last chunk came
    _returned: int = -1  # seq of the chunk last handed out (acknowledged by the next call)
    _acked: int = -1  # seq last acknowledged to the worker (Credit)
    _last_rx: float = 0.0  # monotonic time the last chunk arrived
    _probed: float = 0.0  # monotonic time of the last liveness probe
    _fresh: bool = False  # moved to a new worker that has sent nothing yet (its first-token limit)
    _peeked: tuple[Any, TokenChunk] | None = None  # (message, its chunk) decoded by `has_next`
    tenant: str = field(default_factory=tenancy.current_tenant)  # the API key's tenant; "" without keys
    cache_key: str = ""  # prompt_cache_key: its requests go to one worker (routing.affinity)
    prefix: tuple[int, ...] = ()  # hashes of the prompt's starts where prefix-aware placement applies (prefixes.py)
    chat: list[ChatTurn] | None = None  # a chat's messages, for a worker whose model has a chat template
    chat_end: str = "open"  # how the chat's prompt ends (GenerateRequest.chat_end; policy.chat_end)
    tools: list[dict] | None = None  # the chat's listed tools, for a worker's chat template (GenerateRequest.tools)
    template_kwargs: dict | None = None  # chat_template_kwargs (GenerateRequest.template_kwargs)

    def _ms(self) -> float:
        return (time.monotonic() - self.t0) * 1e3

    def has_next(self) -> bool:
        """Whether the next chunk in order is here already, so `chunks()` hands it out without
        waiting (not when the inbox's first message is past a gap: a lost chunk waits for its
        replay)."""
        if self._expect in self._held:
            return True
        if self._queue is None or self._queue.empty():
            return False
        msg = self._queue._queue[0]  # type: ignore[attr-defined]  # asyncio.Queue's deque: a peek
        try:
            head = decode(msg.data, TokenChunk)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        self._peeked = (msg, head)  # `_next` takes it without a second decode
        return head.seq == self._expect

    def _base(self) -> dict:
        return {"request_id": self.request_id, "deployment": self.deployment.id, "model": self.deployment.model}

    async def _event(self, kind: str, event) -> None:
        await self.gs.event(kind, event)  # best effort; the request goes on

    async def fail(self, status: int, reason: str) -> None:
        """Publish the one `failed` event (idempotent)."""
        if self.terminal:
            return
        self.terminal = True
        self.gs.metrics.finished(self.deployment.id, status)
        await self._terminal_event("failed", Failed(**self._base(), reason=reason, status=status,
                                                    worker_id=self.placement.worker_id if self.placement else "",
                                                    e2e_ms=self._ms()))

    # ------------------------------------------------------------------ phases
    async def start(self) -> None:
        """Predict, dispatch and hand the request to a worker; raises GatewayError."""
        try:
            await self._start()
        except (GatewayError, InvalidRequest) as exc:
            await self.fail(exc.status, exc.message)
            await self.close()
            raise
        except BaseException:
            await self.fail(500, "gateway error before the first token")
            await self.close()
            raise

    async def _start(self) -> None:
        gs, s = self.gs, self.gs.settings
        self.input_tokens = admission.truncated_input(gs, self.deployment, estimate_tokens(self.prompt),
                                                      self.params.truncate_prompt_tokens)
        await self._event("admitted", Admitted(**self._base(), input_tokens=self.input_tokens,
                                               max_tokens=self.params.max_tokens, stream=self.stream,
                                               n=self.params.n))
        admission.check_input(gs, self.deployment, self.input_tokens)
        if prefixes.applies(s.prefix_affinity, self.deployment):
            self.prefix = prefixes.blocks(self.tenant, self.params.cache_salt, self.prompt,
                                          self.adapter.name if self.adapter else "")
        await self._fresh_inbox()
        placement = await self._predict_and_place()
        excluded: list[str] = []
        retries = 0
        while True:
            self._place(placement)
            try:
                self._caps = await self._hand_to(self.placement, self._generate(self._inbox))
                self._sent_at = time.monotonic()
                return
            except BusError as exc:
                # A silence of NATS itself (or of every worker, reconnecting after a NATS stall)
                # is not the worker's fault: it costs no retry, else a stall longer than the
                # retries' accept timeouts would use up every worker and fail the request (the
                # dispatcher round trips used to slow the retries down enough to hide this).
                # The worker is still excluded: the generate it may get late was cancelled.
                nats_silent = exc.code == 504 and await self._waited_for_nats()
                if exc.code not in (503, 504) or (not nats_silent and retries >= s.dispatch_retries):
                    raise status_of(exc, f"worker {self.placement.worker_id}") from exc
                retries += 0 if nats_silent else 1
                logger.warning("worker %s did not accept %s (%s%s); re-dispatching", self.placement.worker_id,
                               self.request_id, exc.description, "; NATS was silent" if nats_silent else "")
                excluded.append(self.placement.worker_id)
                placement = await self._dispatch(excluded)
                await self._fresh_inbox()

    async def _waited_for_nats(self) -> bool:
        """After a worker did not answer: whether the silence was NATS's rather than the worker's
        (the gateway's connection does not answer a ping, or no worker of the deployment was
        heard within its TTL: the whole fleet is reconnecting after a NATS stall) and has ended
        within `idle_timeout_s`. False at once when NATS answers and a worker was heard."""
        gs, dep = self.gs, self.deployment.id

        async def fine() -> bool:
            return bool(gs.fresh_heartbeats(dep)) and await gs.bus_healthy(grace=0.0)

        if await fine():
            return False
        deadline = time.monotonic() + gs.settings.idle_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            if await fine():
                return True
        return False

    async def _predict_and_place(self) -> Placement:
        """The prediction, then the placement that uses it; or, when the deployment's policy
        places without the prediction (admission.USES_PREDICTION), both asked at once: one
        round trip less on the critical path, and the worker still gets the hint. When the
        gateway places the request itself on a worker with a free batch slot (routing.py), it
        does not wait for the prediction at all: the request starts at once, so its place in the
        worker's queue, the only thing the hint orders, cannot matter. It then carries the
        gateway's own estimate, and the predictor's answer (asked all the same, batched:
        predict_batch.py) is recorded when it comes, before the request's terminal event."""
        # max_tokens is per sequence (each of the n choices stops there); the predictor
        # clamps its estimate to it, so the gateway passes the estimate on as it is.
        ask = PredictRequest(request_id=self.request_id, model=self.deployment.model, prompt=self.prompt,
                             input_tokens=self.input_tokens, max_tokens=self.params.max_tokens)
        if self.deployment.policy in admission.USES_PREDICTION:
            self.prediction = await admission.predict(self.gs, ask, self._base())
            return await self._dispatch([])
        here = admission.place_here(self.gs, self._dispatch_request([]), self.deployment.policy, self.prefix)
        if here is not None and here[1]:
            self.prediction = admission.local_prediction(self.gs, ask)
            # asked with others in one message (predict_batch.py): nothing waits for it
            self._predicting = admission.predict_later(self.gs, ask, self._base())
            self._predicting.add_done_callback(self._took_prediction)
            await admission.announce(self.gs, self._base(), here[0], 0.0)
            return here[0]
        predicted = asyncio.ensure_future(admission.predict(self.gs, ask, self._base()))
        try:
            placement = await self._dispatch([], after=predicted, here=here[0] if here else None)
        except BaseException:
            predicted.cancel()
            raise
        self.prediction = await predicted  # never fails: a local estimate past its budget
        return placement

    def _took_prediction(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.prediction = fut.result()

    async def _terminal_event(self, kind: str, event: Completed | Failed) -> None:
        """Publish the request's terminal event. When its prediction is still on the way (a
        request that did not wait for it), after it, in the background: `predicted` precedes
        the terminal event, `completed` carries the predictor's estimate, and the client's
        response does not wait for either (the wait is bounded by `predict_timeout_s`)."""
        pending = self._predicting
        if pending is None or pending.done():
            await self._event(kind, event)
            return
        if kind == "completed":  # the client key's usage now: its settlement reads it when the response ends
            self.gs.count_usage(event)

        def after_prediction(_: asyncio.Future) -> None:  # runs after `_took_prediction`, added earlier
            ev = event
            if isinstance(ev, Completed) and self.prediction is not None:
                ev = msgspec.structs.replace(ev, predicted_tokens=self.prediction.tokens_estimate)
            try:
                self.gs.emit(kind, ev, counted=True)
            except Exception:  # a bug, never a fault: say so loudly (the request's one terminal event)
                logger.exception("the %s event of %s could not be published", kind, self.request_id)

        pending.add_done_callback(after_prediction)  # a callback, not a task per request (issue 15)
        self.gs.track(pending)  # a draining gateway waits for it

    def _place(self, placement: Placement) -> None:
        """Run on `placement` now: this gateway's requests per worker and prompt starts follow."""
        self.gs.router.assign(self.request_id, placement.worker_id)
        self.gs.placed_prefix(self.deployment.id, self.prefix, placement.worker_id)
        self.placement = placement

    async def _dispatch(self, excluded: list[str], after: asyncio.Future | None = None,
                        here: Placement | None = None) -> Placement:
        return await admission.place(self.gs, self._dispatch_request(excluded), self._base(), after,
                                     self.deployment.policy, here, self.prefix)

    def _dispatch_request(self, excluded: list[str]) -> DispatchRequest:
        p, a = self.prediction, self.adapter
        return DispatchRequest(
            request_id=self.request_id, deployment=self.deployment.id, model=self.deployment.model,
            input_tokens=self.input_tokens, predicted_tokens=p.tokens_estimate if p else 0,
            length_class=p.length_class if p else -1, adapter=a.name if a else None, priority=self.priority,
            exclude=excluded, adapter_rank=a.rank if a else 0, max_tokens=self.params.max_tokens,
            affinity=routing.affinity(self.tenant, self.cache_key))

    def _generate(self, inbox: str, resume: Resume | None = None) -> GenerateRequest:
        p, a = self.prediction, self.adapter
        # a long chat's transcript is left for the worker to rebuild; one with tools or calls never
        # (only the gateway renders their transcript)
        inline = self.chat is None or len(self.prompt) <= INLINE_TRANSCRIPT_CHARS or self.tools is not None \
            or any(t.tool_calls or t.role == "tool" for t in self.chat)
        return GenerateRequest(request_id=self.request_id, deployment=self.deployment.id,
                               model=self.deployment.model, prompt=self.prompt if inline else "",
                               input_tokens=self.input_tokens,
                               params=self.params, stream_to=inbox, adapter=a.name if a else None,
                               adapter_path=a.path if a else "", priority=admission.fair_priority(self.priority),
                               predicted_tokens=p.tokens_estimate if p else 0,
                               length_class=p.length_class if p else -1,
                               window=self.gs.settings.stream_window, resume=resume, stream=self.stream,
                               last_on_done=not self.stream and self.params.n == 1, tenant=self.tenant,
                               chat=self.chat, chat_end=self.chat_end if self.chat is not None else "open",
                               tools=self.tools, template_kwargs=self.template_kwargs or {})

    async def _next(self, first: bool) -> TokenChunk:
        """The next chunk in `seq` order. Chunks that overtook a missing one are held and
        duplicates dropped; a gap not filled within `gap_wait_s` is asked of the worker again,
        else the stream fails (never a normal end after a gap). Raises WorkerDied when the
        worker is gone, GatewayError when it is silent longer than the limit."""
        s = self.gs.settings
        first = first or self._fresh
        limit = s.first_token_timeout_s if first else s.idle_timeout_s
        deadline = time.monotonic() + limit
        await self._credit()  # the caller has handed out the chunk returned last
        while True:
            held = self._held.pop(self._expect, None)
            if held is not None:
                if (got := self._take(held)) is not None:
                    return got
                continue
            if self._held and time.monotonic() - self._gap_since > s.gap_wait_s:
                await self._fill_gap()
                continue
            try:
                msg = await next_message(self._queue, 0.25)
            except TimeoutError:
                await self._quiet(deadline, limit, first)
                continue
            err = error_of(msg)
            if err is not None:
                raise GatewayError(err.code, err.description)
            peeked, self._peeked = self._peeked, None
            chunk = peeked[1] if peeked is not None and peeked[0] is msg else decode(msg.data, TokenChunk)
            if (got := self._take(chunk)) is not None:
                return got

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        """Relay the worker's chunks; the done chunk is yielded last. Publishes the terminal event."""
        first = True
        try:
            while True:
                try:
                    chunk = await self._next(first)
                except WorkerDied as died:
                    chunk = await self._migrate(died.reason)
                    if chunk is None:
                        continue
                if chunk.redirect is not None:
                    await self._redirect(chunk.redirect)
                    continue
                self._count(chunk)
                self.simulated = self.simulated or chunk.simulated
                if chunk.finish_reason and not (chunk.done and self.finish_reason):
                    self.finish_reason = chunk.finish_reason  # (a done chunk may carry the last delta)
                if chunk.error:
                    raise GatewayError(502, f"worker {self.placement.worker_id}: {chunk.error}")
                if first and (chunk.text or chunk.tokens):
                    first = False
                    await self._event("first_token", FirstToken(**self._base(), worker_id=self.placement.worker_id,
                                                                ttft_ms=self._ms()))
                    self.gs.metrics.ttft(self.deployment.id, self._ms() / 1e3)
                if chunk.done:
                    # Not acknowledged: the worker keeps an ended stream's chunks for replay until
                    # `replay_linger_s` passes (worker/handlers.py `_linger`) whether or not a
                    # credit comes, so a credit now would only free them sooner, for one more NATS
                    # message and worker wake-up per request (issue 15).
                    self._returned = chunk.seq
                    # The terminal event first: a consumer may stop iterating at the done chunk.
                    await self._completed(chunk)
                    yield chunk
                    return
                yield chunk
        except GatewayError as exc:
            await self.fail(exc.status, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away. The surrounding scope may cancel every further
            # await, so the clean-up runs as a task of its own.
            self.gs.spawn(self.cancel("client disconnected"))
            raise
        finally:
            self.release()  # nothing to wait for: no clean-up task per request (issue 15)

    def _count(self, chunk: TokenChunk) -> None:
        """What the client has been given, per choice: what a migrated stream continues from."""
        if chunk.done and not chunk.tokens and not chunk.text:
            return
        i = chunk.index
        self._out_text.setdefault(i, []).append(chunk.text)  # joined only if the stream migrates
        self._out_tokens[i] = self._out_tokens.get(i, 0) + chunk.tokens
        if chunk.finish_reason:
            self._finished.add(i)

    async def _redirect(self, placement: Placement) -> None:
        """The worker gave the request back before starting it (dispatcher re-balancing):
        send it to the new placement; if that worker refuses, dispatch it afresh."""
        gs, s = self.gs, self.gs.settings
        old = self.placement.worker_id if self.placement else ""
        now = time.monotonic()
        self._moved_ms += (now - (self._sent_at or now)) * 1e3
        self.redirects += 1
        if self.redirects > s.dispatch_retries + 8:
            raise GatewayError(502, f"request moved between workers {self.redirects} times; giving up")
        target = placement
        for attempt in range(s.dispatch_retries + 1):
            try:
                self._caps = await gs.bus.request(target.generate_subject, self._generate(self._inbox),
                                                  GenerateAccepted, timeout=s.accept_timeout_s,
                                                  span_name="generate (moved)")
            except BusError as exc:
                if attempt >= s.dispatch_retries:
                    raise status_of(exc, f"worker {target.worker_id}") from exc
                logger.warning("worker %s did not take moved request %s (%s); re-dispatching",
                               target.worker_id, self.request_id, exc.description)
                target = await self._dispatch([old, target.worker_id])
                continue
            self._place(target)
            self._sent_at = time.monotonic()
            if target is placement:
                await self._event("dispatched", Dispatched(**self._base(), worker_id=target.worker_id,
                                                           policy=f"{target.policy}:moved", latency_ms=0.0))
            logger.info("request %s moved from %s to %s before it started", self.request_id, old,
                        target.worker_id)
            return

    async def _completed(self, chunk: TokenChunk) -> None:
        if self.terminal:
            return
        self.terminal = True
        st = chunk.stats
        e2e = self._ms()
        self.gs.metrics.finished(self.deployment.id, 200, e2e / 1e3)
        if st:  # the gateway's own history, for its local length estimate when the predictor is away
            self.gs.lengths.observe(self.deployment.model, self.input_tokens,
                                    st.output_tokens // max(1, self.params.n))
        await self._terminal_event("completed", Completed(
            **self._base(), worker_id=self.placement.worker_id,
            input_tokens=st.input_tokens if st else self.input_tokens,
            output_tokens=st.output_tokens if st else 0, e2e_ms=e2e,
            ttft_ms=(st.ttft_ms + self._moved_ms) if st else 0.0,
            queue_ms=(st.queue_ms + self._moved_ms) if st else 0.0,
            tbt_mean_ms=st.tbt_mean_ms if st else 0.0, tbt_max_ms=st.tbt_max_ms if st else 0.0,
            atgt_ms=st.atgt_ms if st else 0.0,
            predicted_tokens=self.prediction.tokens_estimate if self.prediction else 0,
            finish_reason=self.finish_reason, simulated=self.simulated, migrations=self.migrations,
            cached_tokens=st.cached_tokens if st else 0))

    async def cancel(self, reason: str) -> None:
        """Cancel at the worker (frees its slot at once) and record the failure."""
        if self.placement is not None and not self.terminal:
            with contextlib.suppress(Exception):
                await self.gs.bus.publish(self.placement.cancel_subject,
                                          CancelRequest(request_id=self.request_id, reason=reason))
        await self.fail(499, reason)
        await self.close()

    async def close(self) -> None:
        self.release()

    def release(self) -> None:
        """The request no longer counts against its worker, and its inbox is closed (idempotent)."""
        self.gs.router.release(self.request_id)
        if self._inbox:
            self.gs.bus.close_inbox(self._inbox)

    async def collect(self) -> Outcome:
        """Run to the end and gather the n choices (non-streamed responses)."""
        n = self.params.n
        out = Outcome(texts=[""] * n, finish=[None] * n, logprobs=[[] for _ in range(n)],
                      prompt_logprobs=[None] * n, prompts=[self.prompt] * n, token_ids=[[] for _ in range(n)],
                      prompt_token_ids=[None] * n)
        async for chunk in self.chunks():
            if 0 <= chunk.index < n:
                out.texts[chunk.index] += chunk.text
                out.logprobs[chunk.index] += chunk.logprobs or []
                if chunk.prompt_logprobs is not None:
                    out.prompt_logprobs[chunk.index] = chunk.prompt_logprobs
                out.token_ids[chunk.index] += chunk.token_ids or []
                if chunk.prompt_token_ids is not None:
                    out.prompt_token_ids[chunk.index] = chunk.prompt_token_ids
                # a done chunk's finish reason is the request's; with one choice it may also
                # end that choice (its last delta on the done chunk: `last_on_done`)
                if chunk.finish_reason and (not chunk.done or (n == 1 and out.finish[0] is None)):
                    out.finish[chunk.index] = chunk.finish_reason
            if chunk.done and chunk.stats:
                out.prompt_tokens, out.cached_tokens = chunk.stats.input_tokens, chunk.stats.cached_tokens
                out.completion_tokens = chunk.stats.output_tokens
        out.simulated = self.simulated
        out.finish = [f or "stop" for f in out.finish]
        return out
