"""The overload burst of the chaos suite, in a process of its own:
`python -m polyserve.bench.chaos_burst URL MODEL RATE SECONDS TOKENS HANG_S` starts streamed
completions at RATE per second for SECONDS (open loop: a 429 is not retried, every request is
a new connection, as independent clients would be) and prints one JSON list of results.

httpx costs the client several times the CPU the gateway spends on a 429 (measured: 14 s of
client CPU for 4 s of gateway CPU at 160 requests/s), so a burst sent with it measures the load
generator. This client writes a prepared request on a raw socket and parses only the status,
the headers it needs and the SSE events, in a process apart from the harness's own clients.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit


def _request(host: str, port: int, model: str, tokens: int) -> bytes:
    body = json.dumps({"model": model, "prompt": "chaos suite: stream until the end", "max_tokens": tokens,
                       "min_tokens": tokens, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return await reader.read()
    out = bytearray()
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)


def _judge(res: dict, body: bytes, tokens: int) -> None:
    """ok / short / error from the SSE body of a 200 (as chaos_load._read)."""
    words, finish, done = 0, None, False  # one word per sim token
    for line in body.decode(errors="replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        ev = json.loads(data)
        if "error" in ev:
            res.update(kind="error", detail=str(ev["error"].get("message"))[:200])
            return
        res["rid"] = res.get("rid") or ev.get("id", "")
        for choice in ev.get("choices", []):
            words += len((choice.get("text") or "").split())
            finish = choice.get("finish_reason") or finish
    res["tokens"] = words
    if not done:
        res.update(kind="error", detail="connection closed before [DONE]")
    elif words < tokens or finish is None:
        res.update(kind="short", detail=f"[DONE] after {words}/{tokens} tokens")
    else:
        res["kind"] = "ok"


async def one(host: str, port: int, payload: bytes, tokens: int, hang_s: float) -> dict:
    res = {"kind": "error", "status": None, "t_start": time.monotonic(), "retry_after": False, "detail": "",
           "tokens": 0, "rid": ""}
    writer = None
    try:
        async with asyncio.timeout(hang_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            status = await reader.readline()
            res["status"] = int(status.split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            res["retry_after"] = "retry-after" in headers
            body = await _body(reader, headers)
            if res["status"] == 200:
                _judge(res, body, tokens)
            else:
                res["detail"] = f"HTTP {res['status']}: {body[:160].decode(errors='replace')}"
    except TimeoutError:
        res.update(kind="hung", detail=f"no terminal event within {hang_s:.0f}s")
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        res["detail"] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if writer is not None:
            writer.close()
    res["t_end"] = time.monotonic()
    return res


async def burst(url: str, model: str, rate: float, seconds: float, tokens: int, hang_s: float) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = _request(host, port, model, tokens)
    tasks: list[asyncio.Task] = []
    t0 = time.monotonic()
    while (now := time.monotonic()) - t0 < seconds:
        for _ in range(max(0, int((now - t0) * rate) + 1 - len(tasks))):
            tasks.append(asyncio.create_task(one(host, port, payload, tokens, hang_s)))
        await asyncio.sleep(0.002)
    offered = len(tasks) / (time.monotonic() - t0)
    return {"offered_per_s": offered, "results": list(await asyncio.gather(*tasks))}


def main(argv: list[str]) -> int:
    url, model, rate, seconds, tokens, hang_s = argv
    out = asyncio.run(burst(url, model, float(rate), float(seconds), int(tokens), float(hang_s)))
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
