"""The chaos suite's clients (`polyserve bench chaos`, tests/chaos): streaming requests over
real HTTP, each judged by what the client saw, and recovery probes.

A stream asks for exactly `tokens` tokens (`min_tokens` = `max_tokens`), so its outcome is
unambiguous: `ok` (every token, then `finish_reason` and `data: [DONE]`), `error` (an HTTP
error status, an error event in the stream, or a connection cut before `[DONE]`: the client
can tell), `short` (a normal end, `[DONE]`, with fewer tokens than asked: the silent loss the
suite exists to catch) or `hung` (nothing terminal within the bound). The sim engine emits one
word per token, so the words of the stream are its tokens.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    kind: str  # ok | error | short | hung
    t_start: float  # monotonic
    t_end: float
    status: int | None = None  # HTTP status (None: no response)
    tokens: int = 0
    rid: str = ""  # the request id the gateway gave the stream (its events carry it)
    detail: str = ""
    retry_after: bool = False  # a 429/503 that carried Retry-After
    tag: str = "load"  # load | slow | burst

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


def _body(model: str, tokens: int) -> dict:
    return {"model": model, "prompt": "chaos suite: stream until the end", "max_tokens": tokens,
            "min_tokens": tokens, "stream": True}


def _event(line: str) -> dict | str | None:
    """A parsed SSE data line: a dict, "[DONE]", or None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        return json.loads(data)
    except ValueError:
        return {"error": {"message": f"unparseable event {data[:80]!r}"}}


async def _read(resp: httpx.Response, res: StreamResult, tokens: int, stall_s: float) -> None:
    """Read the SSE body into `res` (kind ok, short or error)."""
    if stall_s:
        await asyncio.sleep(stall_s)  # a slow reader: nothing read, the socket buffers fill
    finish, done = None, False
    async for line in resp.aiter_lines():
        ev = _event(line)
        if ev is None:
            continue
        if ev == "[DONE]":
            done = True
            break
        if "error" in ev:
            res.kind, res.detail = "error", str(ev["error"].get("message", ev["error"]))[:400]
            return
        res.rid = res.rid or ev.get("id", "")
        for choice in ev.get("choices", []):
            res.tokens += len((choice.get("text") or "").split())  # one word per sim token
            finish = choice.get("finish_reason") or finish
    if not done:
        res.kind, res.detail = "error", "connection closed before [DONE]"
    elif res.tokens < tokens or finish is None:
        res.kind, res.detail = "short", f"[DONE] after {res.tokens}/{tokens} tokens (finish_reason {finish})"
    else:
        res.kind = "ok"


async def stream_once(client: httpx.AsyncClient, url: str, model: str, tokens: int, hang_s: float,
                      tag: str = "load", stall_s: float = 0.0) -> StreamResult:
    """One streamed completion, judged (module docstring); never raises."""
    res = StreamResult(kind="error", t_start=time.monotonic(), t_end=0.0, tag=tag)
    try:
        async with asyncio.timeout(hang_s):
            async with client.stream("POST", url + "/v1/completions", json=_body(model, tokens)) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    res.retry_after = "retry-after" in resp.headers
                    res.detail = f"HTTP {resp.status_code}: {body[:160]}"
                else:
                    await _read(resp, res, tokens, stall_s)
    except TimeoutError:
        res.kind, res.detail = "hung", f"no terminal event within {hang_s:.0f}s ({res.tokens} tokens read)"
    except httpx.HTTPError as exc:
        cut = f" (a stream cut after HTTP {res.status} and {res.tokens} tokens)" if res.status == 200 else ""
        res.kind, res.detail = "error", f"{type(exc).__name__}{cut}: {exc}"[:200]
    res.t_end = time.monotonic()
    return res


def client(connections: int, timeout: float, small_buffers: bool = False) -> httpx.AsyncClient:
    """An HTTP client; `small_buffers`: a 4 KiB receive buffer, so a reader that stalls pushes
    back on the gateway at once instead of after megabytes of kernel buffering."""
    opts = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)] if small_buffers else None
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=connections,
                                                             max_keepalive_connections=connections),
                                         socket_options=opts)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout, connect=5.0))


@dataclass
class ClosedLoop:
    """`total` streams by `concurrency` clients, one after another each."""

    url: str
    model: str
    total: int
    concurrency: int
    tokens: int
    hang_s: float
    pause_s: float = 0.25  # after a failed request, before the client's next one
    results: list[StreamResult] = field(default_factory=list)
    started: int = 0

    async def run(self) -> list[StreamResult]:
        async with client(self.concurrency, self.hang_s + 5) as c:
            await asyncio.gather(*(self._client(c) for _ in range(self.concurrency)))
        return self.results

    async def _client(self, c: httpx.AsyncClient) -> None:
        while self.started < self.total:
            self.started += 1
            res = await stream_once(c, self.url, self.model, self.tokens, self.hang_s)
            self.results.append(res)
            if res.kind != "ok":  # as a client would: not the rest of its requests into a refusing door at once
                await asyncio.sleep(self.pause_s)

    def in_flight(self) -> int:
        return self.started - len(self.results)


@dataclass
class Probes:
    """Small requests, one after another, from a fault on: when serving came back.

    A probe is disrupted when it fails or takes longer than `slow_s`. Recovery is the time from
    `since` to the end of the first good probe after the last disrupted one (0 when none was
    disrupted; None when the last probe was still disrupted)."""

    url: str
    model: str
    since: float
    slow_s: float = 2.0
    interval_s: float = 0.2
    log: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, end, good)
    failures: list[str] = field(default_factory=list)  # "at +Ns: what", for the report

    async def one(self, c: httpx.AsyncClient) -> None:
        t = time.monotonic()
        try:
            resp = await c.post(self.url + "/v1/completions", timeout=5.0,
                                json={"model": self.model, "prompt": "probe", "max_tokens": 2})
            what = "" if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:120]}"
        except httpx.HTTPError as exc:
            what = f"{type(exc).__name__}: {exc}"[:120]
        end = time.monotonic()
        if not what and end - t > self.slow_s:
            what = f"took {end - t:.1f}s"
        self.log.append((t, end, not what))
        if what:
            self.failures.append(f"+{t - self.since:.1f}s: {what}")

    async def run(self, released: asyncio.Event, settle_s: float = 2.0, hard_s: float = 20.0) -> None:
        """Probe until `released` is set and then until `settle_s` of good probes in a row
        (at most `hard_s` after `released`)."""
        hard = None
        async with client(2, 5.0) as c:
            while hard is None or time.monotonic() < hard:
                await self.one(c)
                if released.is_set():
                    hard = hard or time.monotonic() + hard_s
                    if self._good_run() >= settle_s:
                        return
                await asyncio.sleep(self.interval_s)

    def _good_run(self) -> float:
        """Seconds covered by the trailing run of good probes."""
        start = None
        for t, end, good in reversed(self.log):
            if not good:
                break
            start = t
        return 0.0 if start is None else self.log[-1][1] - start

    def recovery_s(self) -> float | None:
        bad = [i for i, (_, _, good) in enumerate(self.log) if not good]
        if not bad:
            return 0.0
        after = [end for t, end, good in self.log[bad[-1] + 1:] if good]
        return round(after[0] - self.since, 2) if after else None

    def disrupted(self) -> int:
        return sum(1 for _, _, good in self.log if not good)
