"""`polyserve events`: the cluster's events as JSON lines, like `nats sub 'polyserve.>'`.

Live events come over core NATS from the moment the command subscribes. With `--since DURATION`
it first prints the terminal request events (`completed`, `failed`) that the JetStream event
stream (shared/durable.py) kept from that long ago, oldest first: what happened to requests while
nobody was watching (the stream keeps an hour, `durable.MAX_AGE_S`). It reads them with JetStream's
read-only message lookup (STREAM.INFO, STREAM.MSG.GET: the operator's NATS user may publish
nothing else, docs/security.md), a binary search over the sequence for the first event at or
after the start, then one lookup per event.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from datetime import datetime

import msgspec

from polyserve.shared import batching, durable

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `1d` as seconds; ValueError saying the form."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m:
        raise ValueError(f"--since {text!r}: give a duration such as 90s, 15m or 2h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def lines(subject: str, data: bytes) -> list[str]:
    """One printed line per event of a message (several events of a subject may share one:
    shared/batching.py)."""
    bodies = [msgspec.json.encode(e) for e in batching.event_dicts(data)] if batching.is_batch(data) else [data]
    return [f"[{subject}] {b.decode(errors='replace')}" for b in bodies]


def _stamp(raw) -> float:
    """A stored message's time as Unix seconds (JetStream's RFC 3339, nanoseconds and "Z", or the
    client's datetime / its text)."""
    t = raw.time
    if isinstance(t, datetime):
        return t.timestamp()
    m = re.fullmatch(r"([^.Z+]+)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?", str(t or "").strip())
    if not m:
        raise ValueError(f"unreadable message time {t!r}")
    zone = m.group(3) or "Z"
    whole = datetime.fromisoformat(m.group(1) + ("+00:00" if zone == "Z" else zone))
    return whole.timestamp() + (float("0." + m.group(2)) if m.group(2) else 0.0)


async def history(nc, prefix: str, since_s: float, say: Callable[[str], None], limit: int = 0) -> int:
    """Print the stored terminal events of the last `since_s` seconds (at most `limit` lines, 0:
    all); how many lines. Raises what JetStream says when the stream is not there."""
    from nats.js.errors import NotFoundError

    stream = durable.stream_name(prefix)
    jsm = nc.jsm(timeout=durable.API_TIMEOUT_S)
    state = (await jsm.stream_info(stream)).state
    subjects = f"{prefix}.v1.events.request.*"

    async def at_or_after(seq: int):
        try:
            return await jsm.get_msg(stream, seq=seq, subject=subjects, next=True)
        except NotFoundError:
            return None

    cutoff, lo, hi = time.time() - since_s, state.first_seq, state.last_seq + 1
    while lo < hi:  # the first sequence stored at or after the cutoff
        mid = (lo + hi) // 2
        msg = await at_or_after(mid)
        if msg is not None and _stamp(msg) < cutoff:
            lo = msg.seq + 1
        else:
            hi = mid
    printed, seq = 0, lo
    while seq <= state.last_seq and not (limit and printed >= limit):
        msg = await at_or_after(seq)
        if msg is None:
            break
        for line in lines(msg.subject, msg.data or b""):
            if limit and printed >= limit:
                break
            say(line)
            printed += 1
        seq = msg.seq + 1
    return printed


async def run(nc, prefix: str, subject: str, say: Callable[[str], None], since_s: float | None = None,
              count: int = 0, seconds: float = 0.0, url_shown: str = "") -> None:
    """`--since` history first (when asked), then live events until `count` lines or `seconds`."""
    printed = 0
    if since_s is not None:
        try:
            printed = await history(nc, prefix, since_s, say, count)
        except Exception as exc:  # noqa: BLE001 - no JetStream, no stream yet: say so, go on live
            say(f"no stored events to show ({type(exc).__name__}: {exc}); live events follow")
    if count and printed >= count:
        return
    done = asyncio.Event()

    async def on_msg(msg) -> None:
        nonlocal printed
        for line in lines(msg.subject, msg.data):
            say(line)
            printed += 1
            if count and printed >= count:
                done.set()
                return

    await nc.subscribe(subject, cb=on_msg)
    say(f"listening on {subject} at {url_shown}; Ctrl-C to stop")
    try:
        await asyncio.wait_for(done.wait(), timeout=seconds or None)
    except asyncio.TimeoutError:
        pass
