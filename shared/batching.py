"""Events of one subject published together travel as one message (issue 15).

Every request makes its consumers pay per event message: the `completed` event alone wakes four
services (predictor, dispatcher, planner, gpu-agent), each with its JetStream delivery and ack,
and py-spy of those services found the wake-up, not the handling, to be the cost
(docs/benchmarks/overhead.md). So `Bus.publish_soon` gathers events for a short window and
sends the events of one subject as **one** message whose payload is a JSON array of the events:

    {"event": "completed", ...}                                   one event (as before)
    [{"event": "completed", ...}, {"event": "completed", ...}]    several, in publish order

A lone event after a quiet spell still leaves within `COALESCE_S`; while events keep coming
(the previous send was less than the batch window ago) the next send waits until one window
after the previous one, so a busy gateway sends each subject at most ~1/window times a second
and a quiet one adds no delay. Nothing waits on an event (the client has its answer first), and
the dispatcher already counts a `completed` that overtakes its `dispatched` (liveview.py).

Consumers: `Bus.listen` handles both forms (each event of an array is one handler call, in
order); a raw NATS subscriber reads `event_dicts(msg.data)`. A durable (JetStream) message that
carries an array is stored, deduplicated and acknowledged as one message.
"""
from __future__ import annotations

import os
import time
from typing import Any

import msgspec

COALESCE_S = 0.002  # a lone event leaves at most this much later
# While busy, a subject's events are sent at most once per this window. 50 ms, not 10: on the
# 2-core EPYC the four consumers of `completed` and nats-server paid per message, and 10 -> 50 ms
# cut the cluster's CPU per json c8 request by ~10% (100 ms: no further gain within noise;
# docs/benchmarks/overhead.md, twelfth session). What it costs: under load an observer (the
# dispatcher's books, `polyserve events`) hears of a request's step up to 50 ms after it.
BATCH_S = 0.050
MAX_BYTES = 256 * 1024  # one message holds at most this much (nats-server refuses > 1 MB by default)


def batch_window_s() -> float:
    """The busy window: env POLYSERVE_EVENT_BATCH_MS (0 turns batching off: one message per event,
    at most COALESCE_S later, as before this module)."""
    raw = os.environ.get("POLYSERVE_EVENT_BATCH_MS", "")
    try:
        return max(0.0, float(raw) / 1000.0) if raw else BATCH_S
    except ValueError:
        return BATCH_S


def join(items: list[bytes]) -> bytes:
    """One payload for the JSON objects `items` (each already encoded): itself when alone."""
    return items[0] if len(items) == 1 else b"[" + b",".join(items) + b"]"


def is_batch(data: bytes) -> bool:
    """Whether `data` is an array of events rather than one (an event is a JSON object)."""
    return data[:1] == b"["


def event_dicts(data: bytes) -> list[dict[str, Any]]:
    """The events in one event message, as dicts (one or many); [] for something else."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return []
    if isinstance(obj, dict):
        return [obj]
    return [e for e in obj if isinstance(e, dict)] if isinstance(obj, list) else []


class Cadence:
    """The timing rule of the module docstring: the first item after a quiet spell leaves `lone_s`
    later; while items keep coming (the previous send was less than `window_s` ago) the next send
    waits until one window after the previous one. Also the gateway's prediction batches
    (`gateway/predict_batch.py`)."""

    def __init__(self, window_s: float, lone_s: float = COALESCE_S):
        self.window_s = window_s
        self.lone_s = lone_s
        self._last_send = -1e9

    def delay(self) -> float:
        """Seconds until the send that the first item added now should wait for."""
        since = time.monotonic() - self._last_send
        return max(self.lone_s, self.window_s - since) if since < self.window_s else self.lone_s

    def sent(self) -> None:
        self._last_send = time.monotonic()


class Pending(Cadence):
    """The events waiting for the next send, grouped by subject, sent by the `Cadence` rule; in a
    send the subjects go in `send_rank` order (a request's lifecycle, the terminal events last),
    so that no event of a request overtakes an earlier one of the same request."""

    def __init__(self, window_s: float):
        super().__init__(window_s)
        self._groups: dict[str, list[bytes]] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def add(self, subject: str, data: bytes) -> None:
        if not self.window_s or data[:1] != b"{":  # not batchable: a key of its own
            subject = f"{subject}\0{len(self._groups)}"
        self._groups.setdefault(subject, []).append(data)

    def take(self, durable: Any) -> list[tuple[str, bytes]]:
        """(subject, payload) to publish now, in `send_rank` order; empties the groups."""
        groups, self._groups = self._groups, {}
        self.sent()
        out = [(s.split("\0", 1)[0], join(part)) for s, items in groups.items() for part in _parts(items)]
        out.sort(key=lambda sd: send_rank(sd[0], durable))  # stable: first-seen order otherwise
        return out


# A request's steps, in the order its events are sent within one send (`send_rank`).
STAGES = {"admitted": 0, "predicted": 1, "dispatched": 2, "first_token": 3}


def send_rank(subject: str, durable: Any) -> int:
    """Where a subject's message goes in a send: a request's events by its lifecycle (`STAGES`),
    other subjects after them, the terminal (durable) ones last. First-seen order is not enough:
    one send may hold an earlier request's `first_token` before this request's `admitted`, and a
    subject's events travel together, so this request's `first_token` would overtake its
    `admitted` (seen in tests once the window was 50 ms)."""
    if durable(subject) is not None:
        return len(STAGES) + 1
    return STAGES.get(subject.rsplit(".", 1)[-1], len(STAGES))


def _parts(items: list[bytes]) -> list[list[bytes]]:
    """`items` cut, in order, into runs of at most MAX_BYTES each (an item larger alone is one run)."""
    parts: list[list[bytes]] = [[]]
    size = 0
    for item in items:
        if parts[-1] and size + len(item) + 2 > MAX_BYTES:  # "[" + items and commas + "]"
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += len(item) + 1
    return parts
