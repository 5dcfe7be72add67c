"""Request events that must not be lost: `completed` and `failed` (issue 13).

Core NATS delivers a message only to the subscribers connected at that moment: across a
nats-server restart (or one cluster node's death) a terminal event written into a dying
socket, or published while its subscriber was still reconnecting, was gone; the dispatcher
then counted the request against its worker forever. So these two subjects go through a
JetStream stream (`stream_name(prefix)`, file storage, replicated on a NATS cluster):

* publisher (`Outbox`): every terminal event carries a `Nats-Msg-Id` (a digest of subject
  and payload) and a reply inbox; the stream's PubAck takes it out of the outbox. An event
  not acknowledged within `RESEND_AFTER_S` is published again (the reconnect buffer keeps it
  while NATS is down); the stream's duplicate window drops the copies.
* consumers (`DurableSubscription`): a JetStream push consumer per queue group (one
  delivery per group) or per service instance (every instance sees every event), with
  explicit acks: what a consumer missed while disconnected is redelivered after
  `ACK_WAIT_S`; redelivered copies it already handled are skipped by message id.

Chosen over a plain re-publish outbox because a flush only proves that the server got the
message, not that a subscriber who was reconnecting at that moment did; the stream keeps
it until each consumer acknowledges (docs/reliability.md). Where JetStream is off, both
sides fall back to core NATS (best effort, as before) and say so in the log.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.js import api
from nats.js.errors import Error as JsError

logger = logging.getLogger(__name__)

DURABLE_KINDS = ("completed", "failed")
MSG_ID = "Nats-Msg-Id"
DUP_WINDOW_S = 120.0  # a copy re-sent within this window is stored once
MAX_AGE_S = 3600.0  # the stream keeps an event this long (consumers that were away catch up)
MAX_MSGS = 1_000_000  # the oldest go first; no max_bytes: JetStream would reserve it up front per stream
RESEND_AFTER_S = 2.0  # no PubAck by then: publish the same event (same id) again
ACK_WAIT_S = 3.0  # a delivered event not acknowledged by then is delivered again
ACK_EVERY = 64  # a service instance's consumer acknowledges cumulatively: after this many events,
ACK_DELAY_S = 0.05  # or this long after the first one not acknowledged (well within ACK_WAIT_S)
INACTIVE_S = 600.0  # a consumer nobody listens to is removed by the server after this
OUTBOX_MAX = 200_000
API_TIMEOUT_S = 2.0


def stream_name(prefix: str) -> str:
    return f"{prefix}_request_events"


def stream_subjects(prefix: str) -> list[str]:
    return [f"{prefix}.v1.events.request.{kind}" for kind in DURABLE_KINDS]


def prefix_of(subject: str) -> str | None:
    """The cluster prefix when `subject` is a durable event subject, else None."""
    head, sep, kind = subject.rpartition(".v1.events.request.")
    return head if sep and head and kind in DURABLE_KINDS else None


def msg_id(subject: str, data: bytes) -> str:
    return hashlib.blake2b(subject.encode() + b"\0" + data, digest_size=12).hexdigest()


def _sequences(reply: str) -> tuple[int, int]:
    """(stream sequence, consumer delivery sequence) from a JetStream delivery's reply subject:
    $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>, or with
    <domain>.<account hash> after ACK and a random last token (as nats-py's Msg.metadata reads it)."""
    t = reply.split(".")
    at = 5 if len(t) == 9 else 7 if len(t) >= 11 else 0
    try:
        return (int(t[at]), int(t[at + 1])) if at and t[0] == "$JS" else (0, 0)
    except ValueError:  # a format this code does not know: (0, 0), each event acknowledged alone
        return 0, 0


def replicas_for(servers: int) -> int:
    """Stream replicas for a cluster of `servers` nodes: 3 on three or more (survives one
    node's loss), else 1."""
    return 3 if servers >= 3 else 1


async def ensure_stream(nc: NATS, prefix: str, replicas: int = 1) -> bool:
    """Create (or update) the event stream of `prefix`; False when JetStream is unavailable."""
    cfg = api.StreamConfig(name=stream_name(prefix), subjects=stream_subjects(prefix),
                           storage=api.StorageType.FILE, num_replicas=replicas,
                           duplicate_window=DUP_WINDOW_S, max_age=MAX_AGE_S, max_msgs=MAX_MSGS,
                           discard=api.DiscardPolicy.OLD)
    jsm = nc.jsm(timeout=API_TIMEOUT_S)
    try:
        info = await jsm.stream_info(cfg.name)
        if (info.config.num_replicas or 1) < replicas:  # grow only: services that see fewer servers never shrink it
            try:
                await jsm.update_stream(cfg)
            except Exception as exc:  # noqa: BLE001 - the stream works with the replicas it has
                logger.warning("could not raise %s to %d replicas: %s", cfg.name, replicas, exc)
        return True
    except JsError as exc:
        if getattr(exc, "code", None) != 404:
            logger.warning("JetStream stream %s unavailable: %s", cfg.name, exc)
            return False
    except Exception as exc:  # noqa: BLE001 - no responders (JetStream off), timeout
        logger.warning("JetStream unavailable (%s: %s): request events are best effort", type(exc).__name__, exc)
        return False
    try:
        await jsm.add_stream(cfg)
        return True
    except Exception as exc:  # noqa: BLE001 - e.g. a concurrent create, or no meta leader yet
        try:
            await jsm.stream_info(cfg.name)
            return True
        except Exception:  # noqa: BLE001
            logger.warning("could not create JetStream stream %s: %s", cfg.name, exc)
            return False


class Outbox:
    """Terminal events until the stream acknowledges them (module docstring)."""

    def __init__(self, nc: NATS, replicas: int):
        self.nc = nc
        self.replicas = replicas
        self._pending: OrderedDict[str, list[Any]] = OrderedDict()  # token -> [subject, data, headers, sent_at]
        self._ack_prefix = ""
        self._ack_sub: Any = None
        self._js: dict[str, bool] = {}  # prefix -> stream ready
        self._js_checked: dict[str, float] = {}
        # Prefixes whose stream answered once (it exists or was made, or it stored an event):
        # from then on an event is never sent best effort (core NATS) but kept until stored, also
        # while the stream does not answer (a leader election after a node's death: its PubAcks
        # are 503s and its API times out). A stream first seen at the first event was not enough:
        # a node killed before any request ended sent every event of the election best effort.
        self._confirmed: set[str] = set()
        self._task: asyncio.Task | None = None
        self._tokens = itertools.count(1)
        self.resent = 0
        self.dropped = 0
        self.acked = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        prefix = prefix_of(subject) or ""
        if not await self._kept(prefix):
            await self.nc.publish(subject, data, headers=headers)  # best effort: no JetStream here (yet)
            return
        if self._ack_sub is None:
            self._ack_prefix = self.nc.new_inbox()
            self._ack_sub = await self.nc.subscribe(f"{self._ack_prefix}.*", cb=self._on_ack)
            self._task = asyncio.ensure_future(self._resend_loop())
        if len(self._pending) >= OUTBOX_MAX:
            self._pending.popitem(last=False)
            self.dropped += 1
            logger.error("event outbox full (%d): dropped the oldest unacknowledged event", OUTBOX_MAX)
        token = f"{next(self._tokens):x}"
        headers = {**headers, MSG_ID: msg_id(subject, data)}
        self._pending[token] = [subject, data, headers, time.monotonic()]
        await self._send(token)

    async def _send(self, token: str) -> None:
        subject, data, headers, _ = self._pending[token]
        try:
            await self.nc.publish(subject, data, reply=f"{self._ack_prefix}.{token}", headers=headers)
        except Exception as exc:  # noqa: BLE001 - reconnect buffer full, closed: the resend loop retries
            logger.warning("could not publish %s (will retry): %s", subject, exc)

    async def prepare(self, prefix: str) -> bool:
        """Look for `prefix`'s stream now (a publisher's start), so that a fault before its first
        event finds the stream known; whether it answered."""
        return await self._kept(prefix)

    async def _kept(self, prefix: str) -> bool:
        """Whether `prefix`'s events go through the outbox: its stream is ready, or has stored one."""
        return await self._stream_ready(prefix) or prefix in self._confirmed

    async def _stream_ready(self, prefix: str) -> bool:
        now = time.monotonic()
        every = RESEND_AFTER_S if prefix in self._confirmed else 10.0  # a stream that worked: soon again
        if not self._js.get(prefix) and now - self._js_checked.get(prefix, -1e9) > every:
            self._js_checked[prefix] = now
            self._js[prefix] = await ensure_stream(self.nc, prefix, self.replicas)
            if self._js[prefix]:
                self._confirmed.add(prefix)
        return self._js.get(prefix, False)

    async def _on_ack(self, m: NatsMsg) -> None:
        token = m.subject.rsplit(".", 1)[-1]
        status = (m.headers or {}).get("Status", "")
        if status == "503":  # no stream listens: the stream is gone (or not replicated yet)
            entry = self._pending.get(token)
            if entry:
                self._js[prefix_of(entry[0]) or ""] = False
            return
        if b'"error"' in m.data or b'"stream"' not in m.data:  # a PubAck is {"stream":..,"seq":..}
            logger.warning("JetStream refused an event: %s", m.data[:200])
            return
        entry = self._pending.pop(token, None)
        if entry is not None:
            self.acked += 1
            self._confirmed.add(prefix_of(entry[0]) or "")

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(RESEND_AFTER_S / 2)
            if not self.nc.is_connected or not self._pending:
                continue
            now = time.monotonic()
            due = [t for t, e in self._pending.items() if now - e[3] >= RESEND_AFTER_S]
            for token in due:
                entry = self._pending.get(token)
                if entry is None:
                    continue
                prefix = prefix_of(entry[0]) or ""
                if not await self._kept(prefix):
                    continue
                entry[3] = now
                self.resent += 1
                await self._send(token)

    async def close(self, timeout: float) -> None:
        """Wait up to `timeout` for the acknowledgements still pending, then stop."""
        deadline = time.monotonic() + timeout
        while self._pending and self.nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._pending:
            logger.warning("%d request events not acknowledged by JetStream at close", len(self._pending))
        if self._task is not None:
            self._task.cancel()


Handler = Callable[[NatsMsg], Awaitable[None]]


class DurableSubscription:
    """A JetStream push consumer on one durable event subject (module docstring).

    A queue group's consumer (shared by the group's members) acknowledges each event
    (AckExplicit). A consumer of one service instance acknowledges cumulatively (AckAll): the
    last event it handled, at most every `ACK_EVERY` events or `ACK_DELAY_S` after the first
    unacknowledged one, which tells the server about all before it: per request, three of the
    four `completed` consumers' acks and their consumer-state updates in nats-server
    (issue 15). That is safe only while this instance got every delivery: its deliveries are
    numbered without a hole (the consumer sequence of the reply subject) unless one was lost
    (a connection that died with it in flight, a slow-consumer drop). On a hole it acknowledges
    nothing more and replaces the consumer by one that starts after the last event it
    acknowledged (`_resync`); what it had handled since comes again and is skipped by message
    id. Tested in tests/integration/test_event_durability.py.
    """

    def __init__(self, nc: NATS, subject: str, service: str, queue: str, handler: Handler,
                 inbox_prefix: str, replicas: int):
        self.nc, self.subject = nc, subject
        self.handlers = [handler]  # every handler sees every event, in order (`add`)
        self.prefix = prefix_of(subject) or ""
        self.stream = stream_name(self.prefix)
        kind = subject.rsplit(".", 1)[-1]
        who = queue or f"{service}-{uuid.uuid4().hex[:8]}"
        self.consumer = self._name = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{who}-{kind}")
        self.queue = queue
        self.deliver = self._deliver = f"{inbox_prefix}.ev.{self.consumer}"
        self.replicas = replicas
        self.started = datetime.now(timezone.utc)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._sub: Any = None
        self.duplicates = 0
        self.cumulative = not queue  # AckAll (class docstring); the server's choice wins (`_create`)
        self._gen = 0  # the consumer in use; deliveries of an older one are handled, never acked
        self._next = 0  # its delivery sequence expected next (0: the first)
        self._floor = 0  # stream sequence of the last event acknowledged: all up to it were handled
        self._last: tuple[str, int] | None = None  # (reply, stream seq) handled, not acknowledged
        self._unacked = 0
        self._timer: asyncio.TimerHandle | None = None
        self._resync_task: asyncio.Task | None = None
        self._retired: list[Any] = []  # subscriptions of replaced consumers (`_resync`)
        self.acks = 0
        self.resyncs = 0

    async def start(self) -> bool:
        """Create the consumer and subscribe; False when JetStream is unavailable."""
        if not await ensure_stream(self.nc, self.prefix, self.replicas):
            return False
        return await self._create(self._gen)

    async def _create(self, gen: int) -> bool:
        """Create (or find) the consumer of generation `gen` and subscribe to its deliveries."""
        if self._floor:  # a replacement: from the first event not acknowledged
            start: dict[str, Any] = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE,
                                     "opt_start_seq": self._floor + 1}
        else:
            start = {"deliver_policy": api.DeliverPolicy.BY_START_TIME,
                     "opt_start_time": self.started.isoformat().replace("+00:00", "Z")}
        cfg = api.ConsumerConfig(
            durable_name=self.consumer, deliver_subject=self.deliver, deliver_group=self.queue or None,
            filter_subject=self.subject, ack_wait=ACK_WAIT_S,
            ack_policy=api.AckPolicy.ALL if self.cumulative else api.AckPolicy.EXPLICIT,
            max_ack_pending=20_000, inactive_threshold=INACTIVE_S, num_replicas=0, **start)
        jsm = self.nc.jsm(timeout=API_TIMEOUT_S)
        try:
            await jsm.add_consumer(self.stream, cfg)
        except Exception as exc:  # noqa: BLE001 - a queue group's consumer made by another instance
            try:
                info = await jsm.consumer_info(self.stream, self.consumer)
            except Exception:  # noqa: BLE001
                logger.warning("could not create JetStream consumer %s: %s", self.consumer, exc)
                return False
            self.cumulative = info.config.ack_policy == api.AckPolicy.ALL
        self._sub = await self.nc.subscribe(self.deliver, queue=self.queue, cb=functools.partial(self._on_msg, gen=gen))
        return True

    def add(self, handler: Handler) -> None:
        """Another handler of the same events, on this consumer (no second consumer)."""
        self.handlers.append(handler)

    async def handle(self, m: NatsMsg) -> None:
        """Every handler, in the order they were added (each logs its own failures)."""
        for handler in self.handlers:
            await handler(m)

    def seen(self, mid: str) -> bool:
        """Whether `mid` was handled already (a redelivery after a lost ack, or a re-publish)."""
        if not mid:
            return False
        if mid in self._seen:
            return True
        self._seen[mid] = None
        if len(self._seen) > 50_000:
            self._seen.popitem(last=False)
        return False

    def dedupe(self, handler: Handler) -> Handler:
        """`handler` for core NATS deliveries of the same subject (while JetStream is not
        reachable yet), sharing the set of handled message ids with the consumer."""
        async def on_core(m: NatsMsg) -> None:
            if not self.seen((m.headers or {}).get(MSG_ID, "")):
                await handler(m)
        return on_core

    async def start_later(self, on_started: Callable[[], Awaitable[None]]) -> None:
        """Retry `start` (from now on: what core NATS delivered until then was handled) until
        JetStream answers, e.g. once a cluster has elected its leaders; then `on_started`."""
        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            self.started = datetime.now(timezone.utc)
            if await self.start():
                await on_started()
                return
            delay = min(delay * 2, 15.0)

    async def _on_msg(self, m: NatsMsg, gen: int = 0) -> None:
        if not m.reply:  # a status message (idle heartbeat / flow control): nothing to handle
            return
        sseq = 0
        if self.cumulative and gen == self._gen:
            sseq, cseq = _sequences(m.reply)
            if sseq:
                if self._next and cseq != self._next and self._resync_task is None:
                    self._resync_task = asyncio.ensure_future(self._resync(cseq))
                self._next = cseq + 1
        if self.seen((m.headers or {}).get(MSG_ID, "")):
            self.duplicates += 1
        else:
            try:
                await self.handle(m)
            except Exception:  # noqa: BLE001 - the handler logs; ack anyway so it is not redelivered forever
                logger.exception("durable event handler for %s failed", self.subject)
        if not self.cumulative or not sseq and gen == self._gen:
            await self._ack(m.reply)
        elif gen == self._gen and self._resync_task is None and sseq:  # nothing past a hole
            self._last = (m.reply, sseq)
            self._unacked += 1
            if self._unacked >= ACK_EVERY:
                await self._ack_last()
            elif self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(ACK_DELAY_S, self._ack_soon)

    async def _ack(self, reply: str) -> bool:
        try:
            await self.nc.publish(reply, b"+ACK")
        except Exception as exc:  # noqa: BLE001 - redelivered after ACK_WAIT_S, skipped as a duplicate
            logger.debug("could not ack %s: %s", self.subject, exc)
            return False
        self.acks += 1
        return True

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _ack_last(self) -> None:
        """Acknowledge (cumulatively) the last event handled, if not yet."""
        self._stop_timer()
        last, self._last, self._unacked = self._last, None, 0
        if last is not None and await self._ack(last[0]):
            self._floor = max(self._floor, last[1])

    def _ack_soon(self) -> None:
        self._timer = None
        asyncio.ensure_future(self._ack_last())

    async def _resync(self, cseq: int) -> None:
        """A delivery is missing: replace the consumer by one that starts after `_floor`."""
        self.resyncs += 1
        logger.warning("%s: delivery %d of consumer %s came after %d: a delivery was lost; re-reading "
                       "the events from stream sequence %d on", self.subject, cseq, self.consumer,
                       self._next - 1, self._floor + 1)
        self._stop_timer()
        self._last, self._unacked = None, 0
        old_sub, old_name = self._sub, self.consumer
        self._gen, self._next = self._gen + 1, 0
        self.consumer, self.deliver = f"{self._name}-r{self.resyncs}", f"{self._deliver}-r{self.resyncs}"
        delay = 0.5  # (with nothing acknowledged yet it starts where the first one did: `started`)
        try:
            while not await self._create(self._gen):  # JetStream busy (an election): the old
                await asyncio.sleep(delay)  # consumer redelivers meanwhile, nothing acknowledged
                delay = min(delay * 2, 15.0)
        finally:
            self._resync_task = None
        # The old consumer goes; its subscription stays until close(): unsubscribing would cancel
        # a handler it is running (nats-py stops the subscription's task), whose event would then
        # count as seen though not handled. What it still delivers is handled, never acknowledged.
        self._retired.append(old_sub)
        try:
            await self.nc.jsm(timeout=API_TIMEOUT_S).delete_consumer(self.stream, old_name)
        except Exception:  # noqa: BLE001 - expires after INACTIVE_S anyway
            pass

    async def close(self, delete: bool) -> None:
        if self._resync_task is not None:
            self._resync_task.cancel()
        elif self.cumulative and self._last is not None:
            await self._ack_last()
        self._stop_timer()
        for sub in [*self._retired, self._sub]:
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001
                    pass
        if delete and not self.queue:  # an instance's own consumer; a queue group's outlives it
            try:
                await self.nc.jsm(timeout=API_TIMEOUT_S).delete_consumer(self.stream, self.consumer)
            except Exception:  # noqa: BLE001 - expires after INACTIVE_S anyway
                pass
