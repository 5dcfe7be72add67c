"""The gateway under faults of the services around it (issue 13), over real NATS/Redis:
a silent or dead predictor or dispatcher, streams that lose chunks or stop, an admission
race, bad input, and `/readyz` when NATS, Redis or every peer is gone. Peers are real
services (conftest `plane`) or fakes whose replies the test controls."""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.service import GatewayService
from polyserve.proto import (
    AnyEvent,
    Deployment,
    DispatchRequest,
    GenerateAccepted,
    GenerateRequest,
    Placement,
    Prediction,
    PredictRequest,
    RequestStats,
    TokenChunk,
)
from polyserve.shared import infra
from tests.helpers import running, wait_for
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration
FAKE = "w-fake"


def kind(ev) -> str:
    return type(ev).__struct_config__.tag


async def collect_events(bus, subjects, into: list):
    async def on(ev):
        into.append(ev)

    await bus.listen(f"{subjects.prefix}.v1.events.>", AnyEvent, on)
    await bus.nc.flush()


def of(events: list, rid: str, tag: str):
    return next((e for e in events if getattr(e, "request_id", None) == rid and kind(e) == tag), None)


@contextlib.asynccontextmanager
async def gateway_only(make_settings, state, **kw):
    """A real gateway with no peers: the test plays predictor, dispatcher and worker."""
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="least_outstanding"))
    kw.setdefault("port", 0)
    gw = GatewayService(make_settings(GatewaySettings, "gateway", **kw))
    async with running(gw):
        yield gw


async def fake_predictor(bus, subjects):
    async def predict(req: PredictRequest) -> Prediction:
        return Prediction(request_id=req.request_id, model=req.model, length_class=1, tokens_estimate=8,
                          source="test")

    await bus.serve(subjects.predict, PredictRequest, predict)


async def fake_dispatcher(bus, subjects):
    async def place(req: DispatchRequest) -> Placement:
        return Placement(request_id=req.request_id, worker_id=FAKE, generate_subject=subjects.generate(FAKE),
                         cancel_subject=subjects.cancel(FAKE), policy="test")

    await bus.serve(subjects.dispatch, DispatchRequest, place)


async def fake_worker(bus, subjects, seqs: list[int], stop_after: bool = False):
    """A worker that sends chunks with the given `seq`s (the last one `done`, unless
    `stop_after`: then it goes silent), with a few ms between them."""
    tasks: set = set()

    async def send(req: GenerateRequest):
        for i, seq in enumerate(seqs):
            last = i == len(seqs) - 1 and not stop_after
            await bus.publish(req.stream_to, TokenChunk(
                request_id=req.request_id, seq=seq, done=last, text="" if last else f"t{seq} ",
                tokens=0 if last else 1, finish_reason="length" if last else None,
                stats=RequestStats(input_tokens=1, output_tokens=len(seqs) - 1) if last else None))
            await asyncio.sleep(0.005)

    async def generate(req: GenerateRequest) -> GenerateAccepted:
        task = asyncio.ensure_future(send(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return GenerateAccepted(request_id=req.request_id, worker_id=FAKE)

    await bus.serve(subjects.generate(FAKE), GenerateRequest, generate)
    await bus.nc.flush()


async def sse(url: str, body: dict, timeout: float = 20) -> list[str]:
    """The `data:` payloads of a streamed completion."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as h:
        async with h.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
    return out


# ------------------------------------------------------------------ predictor: a hint
async def test_dead_or_silent_predictor_costs_no_request(plane, bus, subjects):
    """No predictor, or one that never answers: every request succeeds; the gateway answers
    the hint itself within its budget (predict_timeout_s, 50 ms) with the 129-token prior."""
    from polyserve.core import length_hint
    from polyserve.predictor import policy as predictor_policy

    assert length_hint.PRIOR_TOKENS == predictor_policy.PRIOR_TOKENS
    assert length_hint.CLASS_BOUNDS == predictor_policy.DEFAULT_CLASS_BOUNDS
    assert GatewaySettings().predict_timeout_s <= 0.05
    events: list = []
    await collect_events(bus, subjects, events)
    async with plane(with_predictor=False) as p:
        dead = await p.client.completions.create(model=MODEL, prompt="no predictor", max_tokens=500)

        async def black_hole(msg):  # a predictor that never answers
            pass

        sub = await bus.nc.subscribe(subjects.predict, cb=black_hole)
        await bus.nc.flush()
        loop = asyncio.get_running_loop()
        stall = [0.0]  # the longest this loop (every service of the plane runs on it) could not run

        async def watch() -> None:
            while True:
                t0 = loop.time()
                await asyncio.sleep(0.005)
                stall[0] = max(stall[0], loop.time() - t0 - 0.005)

        watcher = asyncio.ensure_future(watch())
        t = loop.time()
        try:
            silent = await asyncio.gather(*(p.client.completions.create(model=MODEL, prompt=f"silent {i}",
                                                                        max_tokens=3) for i in range(5)))
        finally:
            watcher.cancel()
        assert loop.time() - t < 2.0
        await sub.unsubscribe()
    for c, cap in [(dead, 500)] + [(c, 3) for c in silent]:
        assert c.choices[0].text
        ev = await wait_for(lambda c=c: of(events, c.id, "predicted"), what="predicted event")
        if c is dead:  # the prior, or (its prediction is not waited for: placed on a free slot, asked in
            # the background) the history once the silent ones completed; CI saw the latter once
            assert (ev.source, ev.tokens_estimate) == ("local-prior", 129) or ev.source == "local-history", ev
        else:  # the gateway's own history once 5 requests completed (these do not wait for it)
            assert ev.source in ("local-prior", "local-history") and ev.tokens_estimate <= cap, ev
        # the budget plus a margin, plus any stall of the loop meanwhile (CI once saw 458 ms
        # here: a pause of the whole process on a busy 2-core box, not a late budget)
        limit = 50 + 150 + (1e3 * stall[0] if c is not dead else 0)
        assert ev.latency_ms < limit, (ev.latency_ms, f"loop stalled up to {1e3 * stall[0]:.0f} ms")
        await wait_for(lambda c=c: of(events, c.id, "completed"), what="completed event")


# ------------------------------------------------------------------ dispatcher: retry, then local
async def test_silent_then_dead_dispatcher_falls_back_to_a_local_placement(make_settings, state, bus, subjects):
    """A dispatcher that never answers is asked twice (a retry may reach another replica of the
    queue group), then the gateway places on the least-outstanding live worker from the
    heartbeats (`dispatched` policy `local-fallback`); with no dispatcher at all, at once."""
    from polyserve.worker.config import WorkerSettings
    from polyserve.worker.service import WorkerService

    events: list = []
    await collect_events(bus, subjects, events)
    asked: list = []

    async def black_hole(msg):
        asked.append(msg)

    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="least_outstanding"))
    worker = WorkerService(make_settings(WorkerSettings, "worker", worker_id="w-local", deployment=MODEL,
                                         model=MODEL, engine="sim", time_scale=0.01, heartbeat_interval_s=0.2,
                                         heartbeat_ttl_s=1.0))
    # local_dispatch off: least_outstanding would be placed in the gateway without asking
    gw = GatewayService(make_settings(GatewaySettings, "gateway", port=0, dispatch_timeout_s=0.3,
                                      local_dispatch=False))
    async with running(worker, gw):
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        await wait_for(lambda: "w-local" in gw.gs._heartbeats, what="the worker's heartbeat")
        dead = await client.completions.create(model=MODEL, prompt="no dispatcher", max_tokens=3)
        sub = await bus.nc.subscribe(subjects.dispatch, cb=black_hole)
        await bus.nc.flush()
        loop = asyncio.get_running_loop()
        t = loop.time()
        silent = await client.completions.create(model=MODEL, prompt="silent dispatcher", max_tokens=3)
        assert loop.time() - t < 2 * 0.3 + 1.5
        assert len(asked) == 2  # one retry, then local
        await sub.unsubscribe()
        await client.close()
    for c in (dead, silent):
        assert c.choices[0].text
        ev = await wait_for(lambda c=c: of(events, c.id, "dispatched"), what="dispatched event")
        assert (ev.policy, ev.worker_id) == ("local-fallback", "w-local")
        await wait_for(lambda c=c: of(events, c.id, "completed"), what="completed event")
    assert "polyserve_gateway_fallbacks_total" in gw.gs.metrics.render().decode()


# ------------------------------------------------------------------ streams: gaps and silence
async def test_lost_chunk_ends_with_an_error_never_done(make_settings, state, bus, subjects):
    """seq 0, 1, 3 then done: chunk 2 never comes, so the stream ends with an explicit error
    event and a `failed` event (502), not `[DONE]`; chunks that only overtook each other
    (0, 2, 1, done) are put back in order and the stream completes."""
    events: list = []
    await collect_events(bus, subjects, events)
    async with gateway_only(make_settings, state, gap_wait_s=0.5) as gw:
        await fake_predictor(bus, subjects)
        await fake_dispatcher(bus, subjects)
        await fake_worker(bus, subjects, [0, 1, 3, 4])
        lines = await sse(gw.url, {"model": MODEL, "prompt": "gap", "max_tokens": 8})
        assert "[DONE]" not in lines
        err = json.loads(lines[-1])["error"]
        assert err["code"] == "502" and "lost 1 chunk" in err["message"], err
        texts = [json.loads(x)["choices"][0]["text"] for x in lines[:-1]]
        assert texts == ["t0 ", "t1 "]  # nothing after the gap reached the client
        rid = json.loads(lines[0])["id"]
        failed = await wait_for(lambda: of(events, rid, "failed"), what="failed event")
        assert failed.status == 502 and not of(events, rid, "completed")
    await bus.stop_intake()  # the next fake worker sends another script

    async with gateway_only(make_settings, state) as gw:
        await fake_predictor(bus, subjects)
        await fake_dispatcher(bus, subjects)
        await fake_worker(bus, subjects, [0, 2, 1, 1, 3])  # reordered, with a duplicate
        lines = await sse(gw.url, {"model": MODEL, "prompt": "reordered", "max_tokens": 8})
        assert lines[-1] == "[DONE]"
        assert [json.loads(x)["choices"][0]["text"] for x in lines[:-1]] == ["t0 ", "t1 ", "t2 "]


async def test_worker_that_stops_sending_ends_with_the_idle_limit_error(make_settings, state, bus, subjects):
    """A stream whose worker goes silent mid-way (alive, heartbeats or not) ends with an explicit
    error once the idle limit (`idle_timeout_s`, at most 10 s by default) passes."""
    assert GatewaySettings().idle_timeout_s <= 10
    async with gateway_only(make_settings, state, idle_timeout_s=1.0) as gw:
        await fake_predictor(bus, subjects)
        await fake_dispatcher(bus, subjects)
        await fake_worker(bus, subjects, [0, 1], stop_after=True)
        loop = asyncio.get_running_loop()
        t = loop.time()
        lines = await sse(gw.url, {"model": MODEL, "prompt": "then silence", "max_tokens": 8})
        assert 0.9 < loop.time() - t < 1.0 + 1.5
        assert "[DONE]" not in lines
        err = json.loads(lines[-1])["error"]
        assert err["code"] == "504" and "idle_timeout_s" in err["message"], err


# ------------------------------------------------------------------ admission
async def test_max_inflight_holds_for_a_burst_after_idle(plane):
    """A burst after idle (the deployment cache stale, so admission awaits Redis) admits at
    most `max_inflight` requests; the others get 429 with Retry-After."""
    limit = 3
    async with plane(max_inflight=limit, deployment_cache_s=0.05, worker_kw={"time_scale": 1.0}) as p:
        await p.client.completions.create(model=MODEL, prompt="warm", max_tokens=1)
        await asyncio.sleep(0.3)  # idle: the cache goes stale
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, p.gateway.inflight)
                await asyncio.sleep(0.001)

        watcher = asyncio.ensure_future(watch())
        async with httpx.AsyncClient(base_url=p.url, timeout=30) as h:
            rs = await asyncio.gather(*(h.post("/v1/completions", json={
                "model": MODEL, "prompt": f"burst {i}", "max_tokens": 20, "min_tokens": 20}) for i in range(24)))
        watcher.cancel()
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(200) <= limit and peak <= limit, (codes.count(200), peak)
        assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 429)


async def test_over_long_prompt_and_lone_surrogate_are_400(plane):
    """A prompt longer than the workers take is a 400 naming the limit (not 503 + Retry-After);
    a lone surrogate ("\\ud800", valid JSON, not UTF-8) in a prompt or a message is a 400."""
    async with plane(worker_kw={"max_input_len": 50}) as p:
        await wait_for(lambda: "w-test" in p.gateway.gs._heartbeats, what="the worker's heartbeat")
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as h:
            r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 100, "max_tokens": 2})
            assert r.status_code == 400 and "retry-after" not in r.headers, r.text
            assert "50" in r.json()["error"]["message"] and "max_input_len" in r.json()["error"]["message"]
            for path, body in (("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}'),
                               ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\ud800"], "max_tokens": 2}'),
                               ("/v1/chat/completions", b'{"model": "%s", "max_tokens": 2, '
                                                        b'"messages": [{"role": "user", "content": "\\ud800"}]}')):
                r = await h.post(path, content=body % MODEL.encode(), headers={"content-type": "application/json"})
                assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], (path, r.text)
            ok = await h.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
            assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------ readiness
async def ready(url: str) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=5) as h:
        r = await h.get("/readyz")
        return r.status_code, r.json()


async def test_readyz_says_why_not_when_nats_is_down_and_recovers(make_settings, state):
    """/readyz (and /health, /ping) is 503 with the reason while the gateway's nats-server is
    down (killed, a real disconnect), and 200 again once it is back."""
    run_dir = Path(tempfile.mkdtemp(prefix="gn-", dir="/tmp"))
    proc, url, _ = infra.start_nats(run_dir)
    port = int(url.rsplit(":", 1)[1])
    try:
        await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim"))
        disp = DispatcherService(make_settings(DispatcherSettings, "dispatcher", nats_url=url))
        gw = GatewayService(make_settings(GatewaySettings, "gateway", nats_url=url, port=0))
        async with running(disp, gw):
            assert await ready(gw.url) == (200, {"ready": True, "draining": False})
            proc.kill()
            proc.wait(5)
            code, body = await wait_for(lambda: _not_ready(gw.url), what="503 while NATS is down")
            assert "NATS" in body["reason"]
            async with httpx.AsyncClient(base_url=gw.url, timeout=5) as h:
                assert [(await h.get(u)).status_code for u in ("/health", "/ping")] == [503, 503]
            proc, _, _ = infra.start_nats(run_dir, port=port)
            await wait_for(lambda: _is_ready(gw.url), timeout=15, what="200 after NATS is back")
    finally:
        if proc.poll() is None:
            infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_readyz_503_without_any_peer_or_with_redis_down_and_nothing_cached(make_settings, prefix):
    """No live dispatcher and no live worker: 503 naming that; Redis gone with no deployment
    cached: 503 naming Redis."""
    from tests.integration.test_dispatcher import private_redis

    with private_redis() as (proc, url):
        gw = GatewayService(make_settings(GatewaySettings, "gateway", redis_url=url, port=0))
        async with running(gw):
            code, body = await ready(gw.url)
            assert code == 503 and "no live dispatcher and no live worker" in body["reason"], body
            infra.stop_pid(proc.pid)
            proc.wait(5)
            await asyncio.sleep(1.1)  # past the registry read's one-second cache
            code, body = await ready(gw.url)
            assert code == 503 and "Redis" in body["reason"], body


async def _not_ready(url: str):
    with contextlib.suppress(httpx.HTTPError):
        code, body = await ready(url)
        return (code, body) if code == 503 else None


async def _is_ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return (await ready(url))[0] == 200
    return False
