"""Slow readers (issue 13): backpressure from the client's socket to the worker. The gateway
acknowledges (`Credit`) the chunks it hands to the client; the worker sends at most
`stream_window` beyond that and holds the rest, so nothing piles up in the gateway's bounded
inbox and nothing is dropped. A client that reads nothing for `slow_reader_limit_s` gets an
explicit error at the end of what it was sent, never a silently short stream.

The client is a real HTTP/1.1 client on a socket with a 4 KiB receive buffer that stops
reading, then reads; real gateway, dispatcher and sim worker on real NATS and Redis."""
from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from polyserve.gateway.delivery import inbox_size
from tests.helpers import wait_for
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration
TOKENS = 2000
WINDOW = 16
# 8 choices x 2000 tokens with 5 logprobs each: ~10 MB of events, more than the loopback socket
# buffers between gateway and client hold (tcp_wmem max 4 MiB), so the stream must wait somewhere.
BIG = {"model": MODEL, "max_tokens": TOKENS, "min_tokens": TOKENS, "n": 8, "logprobs": 5}


async def slow_stream(url: str, body: dict, pause_s: float, on_pause=None) -> list[dict | str]:
    """POST a streamed completion, read nothing for `pause_s` (then call `on_pause`), then read it
    all; the `data:` payloads (JSON, or "[DONE]")."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: no autotuning
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    payload = json.dumps(dict(body, stream=True)).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")  # the headers
    await asyncio.sleep(pause_s)
    if on_pause is not None:
        await on_pause()
    raw = bytearray()
    while chunk := await reader.read(4096):
        raw += chunk
    writer.close()
    out: list[dict | str] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


async def test_slow_reader_holds_the_stream_at_the_worker_and_gets_every_token(plane, caplog):
    """A client that stops reading for 1 s: the worker holds the stream (it waited for credit)
    while the gateway's inbox never overflows; then the client reads every one of the 3000
    tokens of each of the 8 choices and [DONE]."""
    caplog.set_level(logging.ERROR, logger="polyserve.shared.bus")
    async with plane(stream_window=WINDOW, worker_kw={"time_scale": 0.0, "slow_reader_limit_s": 10.0}) as p:
        await wait_for(lambda: "w-test" in p.gateway.gs._heartbeats, what="the worker's heartbeat")
        seen = {}

        async def during_pause():
            seen["holds"] = p.worker.handlers.holds
            seen["running"] = p.worker.engine.load().running + len(p.worker.handlers.streams)

        out = await slow_stream(p.url, dict(BIG, prompt="slow", stream_options={"include_usage": True}),
                                pause_s=1.5, on_pause=during_pause)
        assert seen["holds"] >= 1 and seen["running"] >= 1, seen  # held at the worker, not finished
        assert out[-1] == "[DONE]"
        words = [0] * 8
        for c in out[:-1]:
            for ch in c.get("choices") or []:
                words[ch["index"]] += len(ch["text"].split())
        usage = next(c["usage"] for c in out[:-1] if c.get("usage"))
        assert words == [TOKENS] * 8 and usage["completion_tokens"] == 8 * TOKENS
        assert not [r for r in caplog.records if "overflowed" in r.getMessage()]
        assert inbox_size(WINDOW) < TOKENS  # without the window the inbox could not have held it


async def test_reader_that_stops_for_longer_than_the_limit_gets_an_explicit_error(plane, bus, subjects):
    """A client that reads nothing for longer than the worker's `slow_reader_limit_s` (1 s here):
    the worker stops the request (its slot is freed) and the client, once it reads, finds an
    error event after the chunks it was sent, not [DONE]; a `failed` event says why."""
    from tests.integration.test_gateway_faults import collect_events, of

    events: list = []
    await collect_events(bus, subjects, events)
    async with plane(stream_window=WINDOW, worker_kw={"time_scale": 0.0, "slow_reader_limit_s": 1.0}) as p:
        await wait_for(lambda: "w-test" in p.gateway.gs._heartbeats, what="the worker's heartbeat")

        async def during_pause():
            await wait_for(lambda: p.worker.engine.load().running == 0 and not p.worker.handlers.streams,
                           what="the worker to stop the held stream")

        out = await slow_stream(p.url, dict(BIG, prompt="stalled"), pause_s=2.0, on_pause=during_pause)
        assert "[DONE]" not in out
        err = out[-1]["error"]
        assert err["code"] == "502" and "slow_reader_limit_s" in err["message"], err
        words = sum(len(ch["text"].split()) for c in out[:-1] for ch in c["choices"])
        assert 0 < words < 8 * TOKENS
        rid = out[0]["id"]
        failed = await wait_for(lambda: of(events, rid, "failed"), what="failed event")
        assert failed.status == 502 and not of(events, rid, "completed")
