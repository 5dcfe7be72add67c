"""The gateway's edges and admin inputs are bounded (issue 14): a body over the size limit is a
413 before it is read, request shapes (messages, n, stop) and admin numbers have limits that the
400s name, adapters register only from the configured roots (no symlink escape, no file content
in errors, no paths in /v1/models), and uvicorn drops slow-header connections and caps connections."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import uvicorn

from polyserve.gateway import limits
from polyserve.gateway.config import GatewaySettings
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
CHUNKED = [(b"transfer-encoding", b"chunked")]


async def raw_request(url: str, head: str, body_parts: list[bytes]) -> tuple[int, dict]:
    """Send `head` and `body_parts` on a raw connection (never the whole declared body), read the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode())
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)  # the gateway answers and closes
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


async def test_body_over_the_limit_is_413_before_it_is_read(plane):
    async with plane() as p:
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {10 * 1000 * 1000}\r\n\r\n")
        status, body = await raw_request(p.url, head, [b'{"model": "sim-test", "messages": [' + b" " * 65536])
        assert status == 413, body
        assert "4194304 bytes" in body["error"]["message"] and "max_body_bytes" in body["error"]["message"]
        # chunked: counted as it arrives; the request fails once past the limit
        head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                "transfer-encoding: chunked\r\n\r\n")
        chunk = b" " * (256 * 1024)
        parts = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * 17  # 4.25 MiB, no final chunk
        status, body = await raw_request(p.url, head, parts)
        assert status == 413 and body["error"]["type"] == "invalid_request_error", body
        ok = await p.client.completions.create(model="sim-test", prompt="still serving", max_tokens=2)
        assert ok.choices


async def test_middleware_stops_reading_once_past_the_limit():
    """10 MB offered in 1 MiB pieces: the app gets a 413 after the 5th piece; nothing more is read."""
    reads = 0

    async def receive():
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * MIB, "more_body": reads < 10}

    async def app(scope, receive, send):  # reads the whole body, as a JSON route does
        while (await receive()).get("more_body"):
            pass

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    mw = limits.EdgeLimits(app, max_body_bytes=4 * MIB, body_timeout_s=5, limits=limits.RequestLimits())
    await mw({"type": "http", "headers": CHUNKED}, receive, send)
    assert reads == 5
    assert sent[0]["status"] == 413 and b"max_body_bytes" in sent[1]["body"]


async def test_slow_body_is_408():
    async def receive():
        await asyncio.sleep(10)

    async def app(scope, receive, send):
        await receive()

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    mw = limits.EdgeLimits(app, max_body_bytes=MIB, body_timeout_s=0.2, limits=limits.RequestLimits())
    await asyncio.wait_for(mw({"type": "http", "headers": CHUNKED}, receive, send), 5)
    assert sent[0]["status"] == 408 and b"body_timeout_s" in sent[1]["body"]


async def test_request_shape_limits_name_the_field(plane):
    async with plane(max_messages=100) as p, httpx.AsyncClient(base_url=p.url, timeout=30) as h:
        many = [{"role": "user", "content": "x"}] * 100_000
        r = await h.post("/v1/chat/completions", json={"model": "sim-test", "messages": many})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "100000 messages" in r.json()["error"]["message"] and "limit is 100" in r.json()["error"]["message"]
        r = await h.post("/v1/completions", json={"model": "sim-test", "prompt": "x", "n": 10_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        for stop in (["a", "b", "c", "d", "e"], "s" * 2000):
            r = await h.post("/v1/completions", json={"model": "sim-test", "prompt": "x", "stop": stop})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        r = await h.post("/v1/chat/completions", json={"model": "sim-test", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}] * 100})
        assert r.status_code == 200, r.text


async def test_admin_numbers_and_names_are_bounded(plane, make_settings, state, bus, subjects):
    good = {"id": "b1", "model": "m-b", "engine": "sim"}
    cases = [({"scaler": {"min_replicas": 10**9, "max_replicas": 10**9}}, "scaler.max_replicas"),
             ({"scaler": {"min_replicas": 1, "max_replicas": 2000}}, "scaler.max_replicas"),
             ({"scaler": {"window_s": 0.5}}, "scaler.window_s"),
             ({"scaler": {"window_s": 10**7}}, "scaler.window_s"),
             ({"scaler": {"threshold_ms": 0.01}}, "scaler.threshold_ms"),
             ({"scaler": {"threshold_ms": 1e9}}, "scaler.threshold_ms"),
             ({"ttft_slo_ms": 1e12}, "ttft_slo_ms"), ({"atgt_slo_ms": 0}, "atgt_slo_ms"),
             ({"model": "bad name; rm -rf"}, "model"), ({"model": "m" * 500}, "model"),
             ({"id": "x" * 65}, "id"), ({"id": "a/b"}, "id")]
    async with plane(max_replicas_limit=1024) as p, httpx.AsyncClient(base_url=p.url) as h:
        for change, param in cases:
            r = await h.post("/v1/deployments", json={**good, **change})
            assert r.status_code == 400, (change, r.text)
            assert r.json()["error"]["param"] == param, (change, r.json())
        r = await h.post("/v1/deployments", json={**good, "scaler": {"min_replicas": 10**9, "max_replicas": 10**9}})
        assert "1024" in r.json()["error"]["message"]
        r = await h.post("/v1/deployments", json={**good, "model": "org/Model-7B.v1",
                                                  "scaler": {"min_replicas": 0, "max_replicas": 1024}})
        assert r.status_code == 201, r.text


def fake_adapter(path, rank=8):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return path


async def test_adapters_register_only_under_the_roots(plane, tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    inside = fake_adapter(root / "a8")
    away = fake_adapter(outside / "o8")
    secret = outside / "secret.txt"
    secret.write_text('{"r": "SECRET-do-not-echo"}')
    (root / "link").symlink_to(away)  # a directory link out of the root
    leaky = fake_adapter(root / "leaky")
    (leaky / "adapter_config.json").unlink()
    (leaky / "adapter_config.json").symlink_to(secret)  # a config link out of the root
    bad = fake_adapter(root / "bad")
    (bad / "adapter_config.json").write_text('{"r": "SECRET-do-not-echo"}')

    def reg(path, name="x"):
        return {"name": name, "path": str(path), "deployment": "sim-test"}

    async with plane(adapter_roots=str(root)) as p, httpx.AsyncClient(base_url=p.url) as h:
        r = await h.post("/v1/adapters", json=reg(inside, "a8"))
        assert r.status_code == 201, r.text
        for path, words in ((away, "outside the adapter roots"), (root / "link", "symlink"),
                            (root / ".." / "elsewhere" / "o8", "outside"), (leaky, "symlink"),
                            (bad, "rank"), ("relative/a8", "absolute")):
            r = await h.post("/v1/adapters", json=reg(path))
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == "path" and words in err["message"], (path, err)
            assert "SECRET" not in r.text and str(outside) not in err["message"].replace(str(path), "")
        models = (await h.get("/v1/models")).json()
        [a8] = [m for m in models["data"] if m["id"] == "a8"]
        assert a8["root"] == "a8" and a8["parent"] == "sim-test"
        assert str(tmp_path) not in json.dumps(models)
    async with plane() as p, httpx.AsyncClient(base_url=p.url) as h:  # no root configured: refused, and why
        r = await h.post("/v1/adapters", json=reg(inside, "a9"))
        assert r.status_code == 400 and "POLYSERVE_GATEWAY_ADAPTER_ROOTS" in r.json()["error"]["message"]


@contextlib.asynccontextmanager
async def serving(app, http: str = "h11", **settings):
    """`app` under uvicorn with the gateway's edge settings (limits.uvicorn_kwargs) on `http`."""
    s = GatewaySettings(**settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            **limits.uvicorn_kwargs(s, http))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started, what="uvicorn")
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def slow_app(scope, receive, send):
    await asyncio.sleep(0.6)  # longer than the header timeout: a running request is not cut
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_slow_headers_are_dropped_and_connections_capped(http):
    async with serving(slow_app, http, header_timeout_s=0.3, max_connections=3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the gateway
        writer.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
            r = await h.get("/")
            assert r.status_code == 200 and r.text == "ok"
            await asyncio.sleep(0.5)  # kept alive past the header timeout, idle: still usable
            assert (await h.get("/")).status_code == 200
    async with serving(slow_app, http, header_timeout_s=30, max_connections=2) as port:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
            assert (await h.get("/")).status_code == 503  # a clean 503 beyond the cap
        for _, w in idle:
            w.close()


def test_nofile_soft_limit_is_raised_to_the_hard_limit():
    import resource

    got = limits.raise_nofile_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert got is not None and got[0] == soft
    assert soft == hard or soft >= 1 << 20
