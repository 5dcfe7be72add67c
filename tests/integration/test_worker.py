"""The worker service on real NATS and Redis: the streaming protocol the gateway
relies on, heartbeats, cancel, overload (429), bad input (400) and draining."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from polyserve.proto import (
    CancelRequest,
    GenerateAccepted,
    GenerateRequest,
    Heartbeat,
    SamplingParams,
    TokenChunk,
    WorkerDown,
    WorkerUp,
)
from polyserve.shared.bus import BusError, decode
from polyserve.worker.config import WorkerSettings
from polyserve.worker.service import WorkerService
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration


def gen(rid: str, inbox: str, prompt: str = "tell me about batching", **params) -> GenerateRequest:
    params.setdefault("seed", 3)
    return GenerateRequest(request_id=rid, deployment="default", model="sim-llama2-70b", prompt=prompt,
                           input_tokens=len(prompt.split()), params=SamplingParams(**params), stream_to=inbox)


async def next_chunk(queue: asyncio.Queue, timeout: float = 10.0) -> TokenChunk:
    return decode((await asyncio.wait_for(queue.get(), timeout)).data, TokenChunk)


async def read_stream(queue: asyncio.Queue, timeout: float = 10.0) -> list[TokenChunk]:
    """Chunks until the done chunk (inclusive)."""
    chunks = []
    while not chunks or not chunks[-1].done:
        chunks.append(await next_chunk(queue, timeout))
    return chunks


@pytest.fixture
def worker(make_settings, span_exporter):
    def build(**kw) -> WorkerService:
        kw.setdefault("worker_id", "w-it")
        kw.setdefault("time_scale", 0.0)
        kw.setdefault("heartbeat_interval_s", 0.2)
        kw.setdefault("heartbeat_ttl_s", 1.0)
        return WorkerService(make_settings(WorkerSettings, "worker", **kw), span_exporter=span_exporter)

    return build


async def test_stream_in_order_ending_done_with_stats_and_heartbeat(worker, bus, state, subjects, span_exporter):
    events: asyncio.Queue = asyncio.Queue()
    sub = await bus.nc.subscribe(subjects.worker_event(">"), cb=events.put)
    w = worker()
    async with running(w):
        live = await wait_for(state.live_workers, what="worker heartbeat in Redis")
        hb = live[0]
        assert hb.worker_id == "w-it" and hb.simulated and hb.engine == "sim"
        assert hb.generate_subject == subjects.generate("w-it") and hb.cancel_subject == subjects.cancel("w-it")
        assert hb.kv_capacity > 0 and hb.max_input_len == 4096 and hb.ttl_s == 1.0
        async with bus.inbox() as (inbox, queue):
            acc = await bus.request(subjects.generate("w-it"), gen("r1", inbox, max_tokens=8),
                                    GenerateAccepted, timeout=5)
            chunks = await read_stream(queue)
        assert acc.request_id == "r1" and acc.worker_id == "w-it"
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert all(c.simulated and c.request_id == "r1" for c in chunks)
        body, done = chunks[:-1], chunks[-1]
        assert sum(c.tokens for c in body) == 8 and body[-1].finish_reason == "length"
        assert "".join(c.text for c in body).count(" ") == 7
        assert done.done and done.error is None and done.finish_reason == "length"
        assert done.stats.output_tokens == 8 and done.stats.input_tokens == 6  # ceil(4 words × 1.3)
        # NATS: up, then heartbeats with the load
        kinds = []
        while len([k for k in kinds if k == "heartbeat"]) < 2:
            m = await asyncio.wait_for(events.get(), 5)
            kinds.append(m.subject.rsplit(".", 1)[-1])
        assert kinds[0] == "up"
        decode(m.data, Heartbeat)
    await sub.unsubscribe()
    spans = span_exporter.get_finished_spans()
    server = [s for s in spans if s.name == "worker generate" and s.kind.name == "SERVER"]
    inner = [s for s in spans if s.name == "worker generate" and s.kind.name == "INTERNAL"]
    assert server and inner and inner[0].parent.span_id == server[0].context.span_id
    assert inner[0].attributes["polyserve.simulated"] is True


async def test_a_non_streamed_single_choice_gets_its_last_delta_on_the_done_chunk(worker, bus, subjects):
    """`last_on_done` (issue 15): the worker sends the first delta at once and the rest on the
    done chunk; without it (an older gateway) the done chunk carries no text; n = 2 never."""
    async with running(worker()):
        got = {}
        for rid, kw, n in (("merged", {"last_on_done": True}, 1), ("old", {}, 1),
                           ("two", {"last_on_done": True}, 2)):
            async with bus.inbox() as (inbox, queue):
                req = msgspec.structs.replace(gen(rid, inbox, max_tokens=8, n=n), stream=False, **kw)
                await bus.request(subjects.generate("w-it"), req, GenerateAccepted, timeout=5)
                got[rid] = await read_stream(queue)
    merged, old, two = got["merged"], got["old"], got["two"]
    assert len(merged) == 2 and len(old) == 3  # one chunk fewer
    first, done = merged
    assert not first.done and first.tokens == 1 and first.finish_reason is None
    assert done.done and done.tokens == 7 and done.finish_reason == "length" and done.stats.output_tokens == 8
    assert first.text + done.text == "".join(c.text for c in old)  # the same seed: the same text
    assert old[-1].done and not old[-1].text and old[-1].tokens == 0 and old[-2].finish_reason == "length"
    assert not two[-1].text and sum(c.tokens for c in two) == 16  # n = 2: a chunk per choice's end


async def test_cancel_mid_stream_ends_cancelled(worker, bus, subjects):
    w = worker(time_scale=1.0)
    async with running(w):
        async with bus.inbox() as (inbox, queue):
            await bus.request(subjects.generate("w-it"), gen("r-c", inbox, max_tokens=100_000),
                              GenerateAccepted, timeout=5)
            first = await next_chunk(queue)
            assert first.seq == 0 and not first.done
            ack = await bus.request(subjects.cancel("w-it"), CancelRequest(request_id="r-c"), GenerateAccepted,
                                    timeout=5)
            rest = await read_stream(queue)
        assert ack.queue_position == 0
        assert rest[-1].done and rest[-1].error is None and rest[-1].finish_reason == "cancelled"
        assert any(c.finish_reason == "cancelled" and not c.done for c in rest)
        assert rest[-1].stats.output_tokens < 100_000
        assert w.engine.load().running == 0 and w.engine.load().kv_used == 0
        again = await bus.request(subjects.cancel("w-it"), CancelRequest(request_id="r-c"), GenerateAccepted,
                                  timeout=5)
        assert again.queue_position == -1  # nothing left to cancel


async def test_full_queue_is_429_and_bad_input_is_400(worker, bus, subjects):
    w = worker(time_scale=1.0, max_batch=1, max_waiting=1, max_input_len=16)
    async with running(w):
        async with bus.inbox() as (inbox, queue):
            await bus.request(subjects.generate("w-it"), gen("a", inbox, max_tokens=100_000),
                              GenerateAccepted, timeout=5)
            await next_chunk(queue)  # "a" holds the only batch slot
            acc = await bus.request(subjects.generate("w-it"), gen("b", inbox, max_tokens=5),
                                    GenerateAccepted, timeout=5)
            assert acc.queue_position == 0
            with pytest.raises(BusError) as err:
                await bus.request(subjects.generate("w-it"), gen("c", inbox), GenerateAccepted, timeout=5)
            assert err.value.code == 429 and "queue is full" in err.value.description
            with pytest.raises(BusError) as err:  # the engine's admission check, relayed in the reply
                await bus.request(subjects.generate("w-it"), gen("d", inbox, max_tokens=0), GenerateAccepted,
                                  timeout=5)
            assert err.value.code == 400 and "max_tokens" in err.value.description
            with pytest.raises(BusError) as err:
                await bus.request(subjects.generate("w-it"), gen("e", inbox, prompt="word " * 40),
                                  GenerateAccepted, timeout=5)
            assert err.value.code == 400 and "max_input_len=16" in err.value.description
            hb = w.heartbeat()
            assert hb.running == 1 and hb.waiting == 1
            for rid in ("a", "b"):
                await bus.request(subjects.cancel("w-it"), CancelRequest(request_id=rid), GenerateAccepted,
                                  timeout=5)
            await wait_for(lambda: w.engine.load().waiting == 0 and w.engine.load().running == 0,
                           what="slots freed")


async def test_stop_drains_finishes_short_cancels_long(worker, bus, state, subjects):
    down: asyncio.Queue = asyncio.Queue()
    sub = await bus.nc.subscribe(subjects.worker_event("down"), cb=down.put)
    w = worker(time_scale=1.0, drain_timeout_s=1.0)
    async with running(w):
        await wait_for(state.live_workers, what="worker registered")
        async with bus.inbox() as (short_inbox, short_q), bus.inbox() as (long_inbox, long_q):
            await bus.request(subjects.generate("w-it"), gen("long", long_inbox, max_tokens=100_000),
                              GenerateAccepted, timeout=5)
            await bus.request(subjects.generate("w-it"), gen("short", short_inbox, max_tokens=4),
                              GenerateAccepted, timeout=5)
            await next_chunk(long_q)
            w.request_stop()  # what SIGTERM does
            short = await read_stream(short_q)
            long = await read_stream(long_q, timeout=15)
        assert short[-1].done and short[-1].error is None and short[-1].stats.output_tokens == 4
        assert long[-1].done and long[-1].error == "worker shutting down"
        reasons = [decode((await asyncio.wait_for(down.get(), 5)).data, WorkerDown).reason for _ in range(2)]
        assert reasons == ["draining", "stopped"]
        assert await state.live_workers() == []
        with pytest.raises(BusError) as err:  # intake closed
            await bus.request(subjects.generate("w-it"), gen("late", "x", max_tokens=1), GenerateAccepted,
                              timeout=2)
        assert err.value.code in (503, 504)
    await sub.unsubscribe()


async def test_generated_worker_id_and_up_event(make_settings, bus, subjects, span_exporter):
    ups: asyncio.Queue = asyncio.Queue()
    sub = await bus.nc.subscribe(subjects.worker_event("up"), cb=ups.put)
    w = WorkerService(make_settings(WorkerSettings, "worker", time_scale=0.0), span_exporter=span_exporter)
    assert w.worker_id.startswith("w-") and len(w.worker_id) == 8
    async with running(w):
        up = decode((await asyncio.wait_for(ups.get(), 5)).data, WorkerUp)
        assert up.worker_id == w.worker_id and up.engine == "sim"
    await sub.unsubscribe()
