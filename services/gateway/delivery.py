"""How a stream survives its faults on the gateway's side (issue 13; docs/reliability.md),
as a mixin of `handlers.RequestRun`:

* **lost chunks** — a `seq` gap not filled within `gap_wait_s` is asked of the worker again
  (`ReplayRequest` on its replay subject; it keeps what the client has not had, outbox.py);
  only when that fails does the stream end, with an explicit error — never a normal end;
* **a dead worker** — a stream quiet for `liveness_probe_s` asks the worker to re-send what
  follows the last chunk it got: that recovers a lost tail and proves the worker alive. A
  killed worker's replay subject has no responders (NATS drops a dead connection's
  subscriptions at once), which is the fastest of the three death signals the gateway has:
  the others are the gpu-agent's `worker_down` (only where an agent supervises the worker) and
  heartbeats stopping (after their TTL, and only while NATS itself is healthy: `worker_lost`).
  The request then moves (`_migrate`): one that had not started is simply sent to another
  worker; a started one continues there from prompt + the output the client already has
  (`Resume`, as NVIDIA Dynamo's request migration), up to `max_migrations` times;
* **slow readers** — the gateway acknowledges (`Credit`) what it handed to the client; the
  worker sends at most `stream_window` chunks beyond that, so a client that reads slowly
  holds its stream at the worker instead of overflowing the gateway's inbox.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import nullcontext

import msgspec
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Counter

from polyserve.proto import (
    WORKER_SHUTDOWN,
    CancelRequest,
    Credit,
    Dispatched,
    GenerateAccepted,
    GenerateRequest,
    Placement,
    ReplayReply,
    ReplayRequest,
    RequestStats,
    Resume,
    TokenChunk,
)
from polyserve.shared.bus import BusError, decode, encode, error_of, trace_headers

from .errors import GatewayError, status_of

logger = logging.getLogger(__name__)

NO_RESPONDERS = "503"  # the Status header nats-server sends to a reply subject when nobody listens


async def next_message(queue: asyncio.Queue, timeout: float):
    """The next message of a stream's inbox; TimeoutError after `timeout` seconds. One queued
    already is taken at once. `asyncio.timeout`, not `wait_for`: in Python 3.11 `wait_for` wraps
    the get in a Task of its own (a task, a waiter future and their callbacks per call, on
    every chunk the gateway waits for; issue 15)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout(timeout):
        return await queue.get()


class WorkerDied(Exception):
    """The worker of a stream is gone (or no longer has the stream); `reason` says how we know."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def recoveries(gs) -> Counter:
    """polyserve_gateway_stream_recoveries_total{kind}: replays, migrations, failed recoveries."""
    m = gs.metrics
    counter = getattr(m, "stream_recoveries", None)
    if counter is None:
        counter = m.stream_recoveries = Counter(
            "polyserve_gateway_stream_recoveries_total", "Stream faults the gateway handled, by kind: "
            "replayed (lost chunks sent again), migrated (moved to another worker after its worker died), "
            "unrecoverable (ended with an explicit error)", ["kind"], registry=m.registry)
    return counter


def inbox_size(window: int) -> int:
    """The gateway's inbox of a stream: room for a whole window, a replay of it, and the end."""
    return 4 * window + 64 if window > 0 else 10_000


class Delivery:
    """Replay, liveness probes, credits and migration of one RequestRun (fields live there)."""

    # ------------------------------------------------------------------ handing to a worker
    async def _fresh_inbox(self) -> None:
        """A new inbox for the stream: nothing an earlier worker sends late (its acceptance, its
        chunks) can mix with what the next one sends."""
        if self._inbox:
            self.gs.bus.close_inbox(self._inbox)
        self._inbox, self._queue = await self.gs.bus.open_inbox(inbox_size(self.gs.settings.stream_window))

    async def _hand_to(self, placement: Placement, req: GenerateRequest, span: str = "generate") -> GenerateAccepted:
        """Send `req` to the worker of `placement`; its GenerateAccepted (or error) is the first
        message of the stream's own inbox, ahead of the chunks (one NATS connection keeps its
        order). Cheaper than `bus.request`: no reply inbox, future and timer of its own, and no
        client span unless one is recorded (cProfile: ~3% of the gateway's CPU per request).
        Raises BusError as `bus.request` does: 503 when nobody listens (the server's
        no-responders status), 504 when no answer comes within `accept_timeout_s`; after a 504
        the worker is told to cancel (it may get the request late, after a NATS stall: its
        slot must not go to a stream nobody reads)."""
        nc = self.gs.bus.nc
        recording = trace.get_current_span().is_recording()
        spanned = self.gs.tracer.start_as_current_span(span, kind=SpanKind.CLIENT) if recording else None
        with spanned or nullcontext():
            await nc.publish(placement.generate_subject, encode(req), reply=self._inbox, headers=trace_headers() or None)
            try:
                return await self._acceptance(placement)
            except BusError as exc:
                if exc.code == 504:
                    with contextlib.suppress(Exception):
                        await nc.publish(placement.cancel_subject, encode(CancelRequest(
                            request_id=self.request_id, reason="no acceptance within accept_timeout_s")))
                raise

    async def _acceptance(self, placement: Placement) -> GenerateAccepted:
        """The worker's answer to the generate request, from the stream's inbox. A chunk of
        this request that comes before it (seen after a NATS stall) is not an error: it is kept
        for `_next` (the worker took the request), and when the acceptance itself never comes,
        the chunks stand for it (issue 13: a late or reordered message must not fail a request
        that can still be served)."""
        s = self.gs.settings
        deadline = time.monotonic() + s.accept_timeout_s
        early: list[TokenChunk] = []
        while True:
            try:
                msg = await next_message(self._queue, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if early:
                    return self._accepted(early, GenerateAccepted(
                        request_id=self.request_id, worker_id=placement.worker_id, replay=True,
                        window=s.stream_window))  # what every worker that streams does; resumable unknown: no
                raise BusError(504, f"no answer on {placement.generate_subject} within "
                                    f"{s.accept_timeout_s:.1f}s") from None
            if (msg.headers or {}).get("Status") == NO_RESPONDERS:
                raise BusError(503, f"no service is listening on {placement.generate_subject}")
            err = error_of(msg)
            if err is not None:
                raise err
            try:
                return self._accepted(early, decode(msg.data, GenerateAccepted))
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
            try:
                chunk = decode(msg.data, TokenChunk)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise BusError(502, f"worker {placement.worker_id} sent neither its acceptance nor a chunk: "
                                    f"{msg.data[:120]!r}") from None
            if chunk.request_id != self.request_id:
                logger.warning("inbox of %s got a chunk of %s; dropped", self.request_id, chunk.request_id)
                continue
            early.append(chunk)

    def _accepted(self, early: list[TokenChunk], caps: GenerateAccepted) -> GenerateAccepted:
        """`caps`, with the chunks that came before it held for `_next` (in `seq` order there)."""
        if early:
            logger.info("request %s: %d chunk(s) came before the acceptance of worker %s", self.request_id,
                        len(early), caps.worker_id)
            for c in early:
                if c.seq >= self._expect and c.seq not in self._held:
                    if not self._held:
                        self._gap_since = time.monotonic()
                    self._held[c.seq] = c
        return caps

    # ------------------------------------------------------------------ chunks received
    def _take(self, chunk: TokenChunk) -> TokenChunk | None:
        """`chunk` if it is the next one in order (or a redirect); else held or dropped."""
        self._last_rx = time.monotonic()
        self._fresh = False
        if chunk.done and chunk.error == WORKER_SHUTDOWN and chunk.seq == self._expect:
            raise WorkerDied("it shut down before the stream ended (drain timeout)")
        if chunk.redirect is not None:  # the next worker numbers from 0 again
            self._expect, self._held, self._returned = 0, {}, -1
            return chunk
        if chunk.seq == self._expect:
            self._expect += 1
            self._returned = chunk.seq
            return chunk
        if chunk.seq > self._expect and chunk.seq not in self._held:
            if not self._held:
                self._gap_since = time.monotonic()
            self._held[chunk.seq] = chunk
        return None  # else: a duplicate of a chunk already relayed

    # ------------------------------------------------------------------ replay
    async def _replay(self, from_seq: int, to_seq: int) -> ReplayReply | None:
        """Ask the worker to re-send; WorkerDied when it is gone, None when it did not answer."""
        worker = self.placement.worker_id
        s = self.gs.settings
        try:
            reply = await self.gs.bus.request(self.gs.subjects.replay(worker), ReplayRequest(
                request_id=self.request_id, from_seq=from_seq, to_seq=to_seq), ReplayReply,
                timeout=s.accept_timeout_s, span_name="replay")
        except BusError as exc:
            if exc.code == 503:
                raise WorkerDied("its replay subject has no responders (the process is gone)") from None
            return None
        if not reply.known:
            raise WorkerDied("it no longer has the stream")
        if any(c.seq == self._expect for c in reply.chunks):
            recoveries(self.gs).labels("replayed").inc()
            logger.info("request %s: worker %s re-sent %d chunk(s) from seq %d", self.request_id, worker,
                        len(reply.chunks), from_seq)
        for c in reply.chunks:
            if c.seq >= self._expect and c.seq not in self._held:
                if not self._held:
                    self._gap_since = time.monotonic()
                self._held[c.seq] = c
        return reply

    async def _fill_gap(self) -> None:
        """A gap older than `gap_wait_s`: have it re-sent, else end with an explicit error."""
        lo, hi = self._expect, min(self._held) - 1
        worker = self.placement.worker_id
        why = "the worker keeps no replay buffer"
        if self._caps is not None and self._caps.replay:
            reply = await self._replay(lo, hi)
            if reply is not None and lo in self._held:
                self._gap_since = time.monotonic()
                return
            why = ("the worker did not answer the replay request" if reply is None else
                   f"the worker no longer has them (its buffer starts at seq {reply.first_seq})")
        recoveries(self.gs).labels("unrecoverable").inc()
        raise GatewayError(502, f"lost {hi - lo + 1} chunk(s) of the stream from worker {worker} "
                                f"(seq {lo}..{hi} never arrived) and {why}; the output is incomplete")

    async def _quiet(self, deadline: float, limit: float, first: bool) -> None:
        """Nothing came for a while: keep the credit flowing, probe the worker, check the limits."""
        s, now = self.gs.settings, time.monotonic()
        worker = self.placement.worker_id
        await self._credit(force=True)  # a lost credit must not hold the stream for ever
        if self._caps is not None and self._caps.replay and not self._held and \
                now - max(self._last_rx, self._probed, self._sent_at) > s.liveness_probe_s:
            self._probed = now
            await self._replay(self._expect, -1)  # a lost tail comes back; WorkerDied if gone
            if self._held:
                return
        gone = await self.gs.worker_lost(worker, since=self.t0)
        if gone:
            raise WorkerDied(gone)
        if time.monotonic() > deadline:
            raise GatewayError(504, f"worker {worker} sent nothing for {limit:.0f}s "
                                    f"({'first_token' if first else 'idle'}_timeout_s)")

    # ------------------------------------------------------------------ credits
    async def _credit(self, force: bool = False) -> None:
        """Tell the worker what the client has been handed (every quarter window, or `force`)."""
        window = self._caps.window if self._caps is not None else 0
        if not window or self._returned < 0 or self._returned <= self._acked and not force:
            return
        if force or self._returned - self._acked >= max(1, window // 4):
            self._acked = self._returned
            try:
                await self.gs.bus.nc.publish(self.gs.subjects.credit(self.placement.worker_id),
                                             encode(Credit(request_id=self.request_id, acked=self._acked)))
            except Exception as exc:  # noqa: BLE001 - the next quiet tick sends it again
                logger.debug("credit for %s not sent: %s", self.request_id, exc)

    # ------------------------------------------------------------------ migration
    def _resume_refusal(self) -> str:
        """Why a started stream cannot continue elsewhere ('' when it can)."""
        if self._caps is None or not self._caps.resumable:
            return "its engine cannot continue a started stream elsewhere"
        if self.params.n != 1 or self.params.structured is not None or self.params.return_token_ids:
            return "a started stream with n > 1, a structured output or token ids cannot be continued elsewhere"
        return ""

    async def _migrate(self, reason: str) -> TokenChunk | None:
        """The worker died: move the request, or raise GatewayError saying why it cannot move.
        Returns a done chunk when every choice had already finished (only the end was lost)."""
        s, dead = self.gs.settings, self.placement.worker_id
        self._dead.append(dead)
        sent = sum(self._out_tokens.values())
        started = sent > 0 or any(map(any, self._out_text.values()))
        what = f"worker {dead} failed mid-request: {reason}"
        if started and len(self._finished) >= self.params.n:
            return TokenChunk(request_id=self.request_id, seq=self._expect, done=True, simulated=self.simulated,
                              stats=RequestStats(input_tokens=self.input_tokens, output_tokens=sent))
        refusal = ""
        if self.migrations >= s.max_migrations:
            refusal = f"not moved again after {self.migrations} migration(s) (max_migrations)"
        elif started:
            refusal = self._resume_refusal()
        if refusal:
            recoveries(self.gs).labels("unrecoverable").inc()
            raise GatewayError(502, f"{what}; {refusal}")
        self.migrations += 1
        resume = Resume(text="".join(self._out_text.get(0, [])), tokens=sent, migrations=self.migrations) if started \
            else None
        t = time.monotonic()
        self._expect, self._held, self._returned, self._acked = 0, {}, -1, -1
        self._fresh = True
        try:
            await self._hand_over(resume)
        except GatewayError as exc:
            recoveries(self.gs).labels("unrecoverable").inc()
            raise GatewayError(502, f"{what}; no other worker could take it over: {exc.message}") from None
        recoveries(self.gs).labels("migrated").inc()
        logger.warning("request %s: %s; moved to worker %s (migration %d, %d token(s) already streamed)",
                       self.request_id, what, self.placement.worker_id, self.migrations, sent)
        await self._event("dispatched", Dispatched(**self._base(), worker_id=self.placement.worker_id,
                                                   policy=f"{self.placement.policy}:migrated",
                                                   latency_ms=(time.monotonic() - t) * 1e3))
        return None

    async def _hand_over(self, resume: Resume | None) -> None:
        """Place the request afresh (the dead workers excluded) and have a worker accept it."""
        s = self.gs.settings
        for attempt in range(s.dispatch_retries + 1):
            placement: Placement = await self._dispatch(list(self._dead))
            await self._fresh_inbox()  # a late chunk of the dead worker can never mix with the new stream
            try:
                self._caps = await self._hand_to(placement, self._generate(self._inbox, resume), "generate (migrated)")
            except BusError as exc:
                if attempt < s.dispatch_retries and exc.code in (503, 504):
                    self._dead.append(placement.worker_id)
                    continue
                raise status_of(exc, f"worker {placement.worker_id}") from exc
            self._place(placement)
            self._sent_at = time.monotonic()
            return
