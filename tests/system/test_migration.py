"""Request migration (issue 13): a worker process SIGKILLed mid-stream. Its queued requests are
sent to another worker; its running streams continue there from prompt + the tokens already
sent, so each client sees one uninterrupted stream with the right token count and one
`completed` event. Only when no worker can take a stream over does it end, explicitly.

Gateway and dispatcher run in this test's loop on the session nats-server and redis-server;
the workers are real `python -m polyserve.worker` processes (sim engine), killed by signal.
No gpu-agent: the gateway learns of the death from its liveness probe (the dead worker's
replay subject has no responders), not from a `worker_down` event."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import openai
import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.service import GatewayService
from polyserve.proto import AnyEvent, Deployment
from tests.helpers import running, wait_for

pytestmark = pytest.mark.system
MODEL = "sim-mig"
TOKENS = 120  # at time_scale 0.5 a stream takes about 2 s


def start_worker(infra_servers, prefix: str, worker_id: str) -> subprocess.Popen:
    env = dict(os.environ, POLYSERVE_NATS_URL=infra_servers.nats_url, POLYSERVE_REDIS_URL=infra_servers.redis_url,
               POLYSERVE_PREFIX=prefix, POLYSERVE_WORKER_WORKER_ID=worker_id, POLYSERVE_WORKER_DEPLOYMENT=MODEL,
               POLYSERVE_WORKER_MODEL=MODEL, POLYSERVE_WORKER_ENGINE="sim", POLYSERVE_WORKER_TIME_SCALE="0.5",
               POLYSERVE_WORKER_MAX_BATCH="1", POLYSERVE_WORKER_HEARTBEAT_INTERVAL_S="0.3",
               POLYSERVE_WORKER_HEARTBEAT_TTL_S="3")
    return subprocess.Popen([sys.executable, "-m", "polyserve.worker"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


async def stream(client, prompt: str, started: asyncio.Event | None = None) -> tuple[str, int, list[str]]:
    """(text, completion tokens from usage, finish reasons) of one streamed completion."""
    text, usage, finish = "", 0, []
    s = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, stream=True,
                                        extra_body={"min_tokens": TOKENS}, stream_options={"include_usage": True})
    async for chunk in s:
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.text
            if c.finish_reason:
                finish.append(c.finish_reason)
        if started is not None and len(text.split()) >= 10:
            started.set()
    return text, usage, finish


@pytest.fixture
def workers(infra_servers, prefix):
    procs: dict[str, subprocess.Popen] = {}

    def start(*ids: str) -> dict[str, subprocess.Popen]:
        for wid in ids:
            procs[wid] = start_worker(infra_servers, prefix, wid)
        return procs

    yield start
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


async def plane(make_settings, state, bus, subjects, events: list, **gw_kw):
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="least_outstanding"))

    async def on(ev):
        events.append(ev)

    await bus.listen(f"{subjects.prefix}.v1.events.>", AnyEvent, on)
    await bus.nc.flush()
    disp = DispatcherService(make_settings(DispatcherSettings, "dispatcher"))
    gw = GatewayService(make_settings(GatewaySettings, "gateway", port=0, liveness_probe_s=0.5, **gw_kw))
    return disp, gw


def tag(ev) -> str:
    return type(ev).__struct_config__.tag


async def test_killed_worker_streams_and_queue_continue_on_another(make_settings, state, bus, subjects, workers):
    """Two workers, one sequence each (max_batch 1), four streams: each worker runs one and
    queues one. SIGKILL one worker once its stream is under way: all four streams end normally
    with exactly TOKENS tokens (usage and text), one `completed` event each and no `failed`;
    the dead worker's two moved to the survivor (migrations 1)."""
    events: list = []
    disp, gw = await plane(make_settings, state, bus, subjects, events)
    procs = workers("w-a", "w-b")
    async with running(disp, gw):
        await wait_for(lambda: {"w-a", "w-b"} <= set(gw.gs._heartbeats), timeout=30, what="both workers")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.ensure_future(stream(client, f"prompt {i}", started[i])) for i in range(4)]
        await wait_for(lambda: sum(e.is_set() for e in started) >= 2, timeout=20, what="two streams under way")
        # all four are placed by now; their events leave up to a batch window later (shared/batching.py)
        await wait_for(lambda: sum(tag(e) == "dispatched" for e in events) >= 4, what="four dispatched events")
        dispatched = {e.request_id: e.worker_id for e in events if tag(e) == "dispatched"}
        victim = "w-a"
        assert list(dispatched.values()).count(victim) == 2, dispatched  # one running, one queued
        os.kill(procs[victim].pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        await client.close()
    for text, usage, finish in results:
        assert usage == TOKENS and len(text.split()) == TOKENS, (usage, len(text.split()), text[-80:])
        assert finish == ["length"]
    moved = [rid for rid, w in dispatched.items() if w == victim]
    await wait_for(lambda: sum(tag(e) == "completed" for e in events) >= 4, what="four completed events")
    completed = {e.request_id: e for e in events if tag(e) == "completed"}
    assert len(completed) == 4 and not [e for e in events if tag(e) == "failed"]
    assert all(completed[rid].migrations == 1 and completed[rid].worker_id == "w-b" for rid in moved)
    assert all(completed[rid].output_tokens == TOKENS for rid in completed)
    assert sum(e.policy.endswith(":migrated") for e in events if tag(e) == "dispatched") == 2


async def test_no_worker_left_or_no_migration_allowed_is_an_explicit_error(make_settings, state, bus, subjects,
                                                                         workers):
    """The only worker SIGKILLed mid-stream: the stream ends with an error event naming the worker
    and why it could not move (no other worker), and a `failed` event; with `max_migrations` 0
    the same holds though another worker is there."""
    for max_migrations, ids in ((3, ("w-solo",)), (0, ("w-c", "w-d"))):
        events: list = []
        disp, gw = await plane(make_settings, state, bus, subjects, events, max_migrations=max_migrations)
        procs = workers(*ids)
        async with running(disp, gw):
            await wait_for(lambda: set(ids) <= set(gw.gs._heartbeats), timeout=30, what="the workers")
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            started = asyncio.Event()
            task = asyncio.ensure_future(stream(client, "alone", started))
            await asyncio.wait_for(started.wait(), 20)
            await wait_for(lambda: any(tag(e) == "dispatched" for e in events), what="the dispatched event")
            victim = next(e.worker_id for e in events if tag(e) == "dispatched")
            os.kill(procs[victim].pid, signal.SIGKILL)
            with pytest.raises(openai.APIError) as err:
                await asyncio.wait_for(task, 20)
            await client.close()
        why = "no other worker could take it over" if max_migrations else "max_migrations"
        assert victim in str(err.value) and why in str(err.value), str(err.value)
        await wait_for(lambda: [e for e in events if tag(e) == "failed"], what="a failed event")
        for wid in ids:
            if procs[wid].poll() is None:
                procs[wid].terminate()
                procs[wid].wait(10)
