"""Terminal request events (`completed`, `failed`) survive a nats-server restart (issue 13).

A publisher Bus (as the gateway) sends a steady flow of events while nats-server is
stopped (SIGTERM, or SIGKILL) and started again on the same port and JetStream store; a
queue-group listener (as the predictor) and a plain listener (as the dispatcher) must each
handle every event exactly once, though they reconnect 1.5 s after the publisher. Before shared/durable.py, core NATS dropped the events
published while a subscriber was still reconnecting, and those written into the dying socket.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from polyserve.proto import Completed, Failed, Subjects
from polyserve.shared import infra
from polyserve.shared.bus import Bus
from polyserve.shared.telemetry import make_tracer

pytestmark = pytest.mark.integration

N = 600


def _event(i: int):
    if i % 10 == 9:
        return "failed", Failed(request_id=f"r{i}", reason="test", status=503)
    return "completed", Completed(request_id=f"r{i}", worker_id="w", input_tokens=1, output_tokens=2,
                                  e2e_ms=1.0, ttft_ms=1.0)


async def _until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return pred()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["restart", "kill"])
async def test_terminal_events_survive_a_nats_restart(sig):
    run_dir = Path(tempfile.mkdtemp(prefix="ps-evd-", dir="/tmp"))
    port = infra.free_port()
    proc, url, _ = infra.start_nats(run_dir / "nats", port=port)
    subjects = Subjects(f"evd{os.getpid()}{sig}")
    tracer, _ = make_tracer("t")
    pub = await Bus.connect(url, tracer, "gateway")
    learn, watch = await Bus.connect(url, tracer, "predictor"), await Bus.connect(url, tracer, "dispatcher")
    for slow in (learn, watch):  # consumers that reconnect later than the publisher (busy, or nats-py's
        slow.nc.options["reconnect_time_wait"] = 1.5  # default 2 s): core NATS drops what they miss
    got_queue: list[str] = []
    got_all: list[str] = []

    async def on_queue(ev) -> None:
        got_queue.append(ev.request_id)

    async def on_all(ev) -> None:
        got_all.append(ev.request_id)

    try:
        for kind, typ in (("completed", Completed), ("failed", Failed)):
            await learn.listen(subjects.event(kind), typ, on_queue, queue="predictor-learn")
            await watch.listen(subjects.event(kind), typ, on_all)
        assert len(watch._durable) == 2, "the terminal events must come from JetStream consumers"

        async def produce() -> None:
            for i in range(N):
                kind, ev = _event(i)
                pub.publish_soon(subjects.event(kind), ev)
                await asyncio.sleep(0.004)  # ~2.5 s of steady traffic

        producer = asyncio.create_task(produce())
        await asyncio.sleep(0.8)
        infra.stop_pid(proc.pid, sig=sig)  # mid-flow
        proc.wait(5)
        await asyncio.sleep(0.7)
        proc, _, _ = infra.start_nats(run_dir / "nats", port=port)
        await producer
        want = {f"r{i}" for i in range(N)}
        await _until(lambda: set(got_queue) >= want and set(got_all) >= want, 25.0)
        missing_q, missing_a = want - set(got_queue), want - set(got_all)
        assert not missing_q and not missing_a, (f"lost {len(missing_q)} (queue) / {len(missing_a)} (all) of {N}; "
                                                 f"outbox resent {pub.outbox.resent}, pending {pub.outbox.pending}")
        assert len(got_queue) == N and len(got_all) == N, "each event handled once (duplicates skipped)"
        assert await _until(lambda: pub.outbox.pending == 0, 5.0)
    finally:
        for b in (pub, learn, watch):
            await b.close()
        infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)



async def test_listener_uses_core_nats_until_jetstream_answers_then_switches():
    """A listener started while JetStream does not answer (here: a nats-server without it,
    restarted with it, as a cluster electing its leaders would look) handles events over core
    NATS meanwhile, then moves to its JetStream consumer; each event is handled once."""
    import subprocess

    run_dir = Path(tempfile.mkdtemp(prefix="ps-evs-", dir="/tmp"))
    port = infra.free_port()
    plain = subprocess.Popen([infra.find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = None
    subjects = Subjects(f"evs{os.getpid()}")
    tracer, _ = make_tracer("t")
    try:
        await _until(lambda: infra.port_in_use(port), 5)
        url = f"nats://127.0.0.1:{port}"
        pub, watch = await Bus.connect(url, tracer, "gateway"), await Bus.connect(url, tracer, "dispatcher")
        got: list[str] = []

        async def on(ev) -> None:
            got.append(ev.request_id)

        await watch.listen(subjects.event("completed"), Completed, on)
        assert not watch._durable and watch._retries, "no JetStream: core NATS, and a retry under way"
        await pub.publish(subjects.event("completed"), _event(0)[1])
        assert await _until(lambda: got == ["r0"], 5), got
        plain.terminate()
        plain.wait(5)
        proc, _, _ = infra.start_nats(run_dir / "nats", port=port)  # now with JetStream
        assert await _until(lambda: len(watch._durable) == 1, 20), "moved to its JetStream consumer"
        for i in range(1, 21):
            await pub.publish(subjects.event("completed"), _event(i * 10)[1])
        want = ["r0"] + [f"r{i * 10}" for i in range(1, 21)]
        assert await _until(lambda: sorted(got) == sorted(want), 10), got
        await asyncio.sleep(0.5)
        assert sorted(got) == sorted(want), "each event handled once"
        for b in (pub, watch):
            await b.close()
    finally:
        if plain.poll() is None:
            plain.kill()
        if proc is not None:
            infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_two_handlers_of_one_subject_share_one_consumer():
    """Two handlers of `completed` on one connection (the gpu-agent's service and its MIAD
    loop) get every event from one JetStream consumer: one delivery and one ack per event in
    nats-server, not one per handler (issue 15). A queue group keeps a consumer of its own."""
    run_dir = Path(tempfile.mkdtemp(prefix="ps-evh-", dir="/tmp"))
    proc, url, _ = infra.start_nats(run_dir / "nats")
    subjects = Subjects(f"evh{os.getpid()}")
    tracer, _ = make_tracer("t")
    pub, agent = await Bus.connect(url, tracer, "gateway"), await Bus.connect(url, tracer, "gpu-agent")
    seen: dict[str, list[str]] = {"a": [], "b": [], "q": []}

    def on(key: str):
        async def handler(ev) -> None:
            seen[key].append(ev.request_id)
        return handler

    try:
        await agent.listen(subjects.event("completed"), Completed, on("a"))
        await agent.listen(subjects.event("completed"), Completed, on("b"))
        await agent.listen(subjects.event("completed"), Completed, on("q"), queue="learn")
        assert len(agent._durable) == 2, "one consumer for the two plain handlers, one for the queue group"
        for i in range(50):
            await pub.publish(subjects.event("completed"), _event(i * 10)[1])
        want = [f"r{i * 10}" for i in range(50)]
        assert await _until(lambda: all(v == want for v in seen.values()), 10), seen
        for dsub in agent._durable:  # the plain one acknowledges cumulatively, a little later
            assert await _until(lambda: dsub._last is None, 2.0)
            info = await agent.nc.jsm().consumer_info(dsub.stream, dsub.consumer)
            assert info.delivered.stream_seq >= 50 and info.num_ack_pending == 0
    finally:
        for b in (pub, agent):
            await b.close()
        infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def _gateway_bus(tag: str):
    """A nats-server of its own and a publisher Bus (as the gateway): (bus, subjects, the stream's name)."""
    from polyserve.shared import durable

    run_dir = Path(tempfile.mkdtemp(prefix=f"ps-{tag}-", dir="/tmp"))
    proc, url, _ = infra.start_nats(run_dir / "nats")
    subjects = Subjects(f"{tag}{os.getpid()}")
    tracer, _ = make_tracer("t")
    pub = await Bus.connect(url, tracer, "gateway")
    try:
        yield pub, subjects, durable.stream_name(subjects.prefix)
    finally:
        await pub.close()
        infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_events_are_kept_while_a_stream_that_worked_does_not_answer():
    """Once the event stream has stored an event, a PubAck of 503 (no stream leader: an election
    after a node's death, or the stream gone) must not send the next events best effort over core
    NATS: they stay in the outbox and are stored when the stream answers again (here the stream is
    deleted and the outbox's re-check creates it; CI once lost 10 of 48 terminal events after a
    NATS node's SIGKILL)."""
    async with _gateway_bus("evk") as (pub, subjects, stream):
        await pub.publish(subjects.event("completed"), _event(0)[1])
        assert await _until(lambda: pub.outbox.acked == 1, 5), "the stream stored the first event"
        jsm = pub.nc.jsm()
        await jsm.delete_stream(stream)
        await pub.publish(subjects.event("completed"), _event(10)[1])  # its PubAck: 503
        await asyncio.sleep(0.5)
        for i in range(2, 6):
            await pub.publish(subjects.event("completed"), _event(i * 10)[1])
        assert await _until(lambda: pub.outbox.pending == 0, 12), f"{pub.outbox.pending} never stored"
        info = await jsm.stream_info(stream)
        assert info.state.messages == 5, "the five events after the stream's loss, none best effort"


async def test_a_stream_found_at_start_keeps_the_events_of_an_outage_before_the_first_one():
    """The gateway looks the stream up at its start (`Outbox.prepare`): an outage that begins
    before any request has ended (the chaos suite's NATS node, killed 0.3 s into the load while
    it led the stream) must not send the events best effort. Before, only a stored event made the
    stream count as known, and the whole election's events went over core NATS, none stored."""
    async with _gateway_bus("evp") as (pub, subjects, stream):
        assert await pub.outbox.prepare(subjects.prefix), "the stream answered at the start"
        jsm = pub.nc.jsm()
        await jsm.delete_stream(stream)  # the outage: PubAcks are 503s until a re-check makes it again
        for i in range(5):
            await pub.publish(subjects.event("completed"), _event(i * 10)[1])
            await asyncio.sleep(0.2)
        assert await _until(lambda: pub.outbox.pending == 0, 12), f"{pub.outbox.pending} never stored"
        info = await jsm.stream_info(stream)
        assert info.state.messages == 5, "every event of the outage stored, none sent best effort"


async def test_a_service_instance_acknowledges_cumulatively_and_rereads_after_a_lost_delivery(monkeypatch):
    """Issue 15: a consumer of one service instance (AckAll) acknowledges the last event it
    handled, not each one: far fewer acks than events, none left pending. A delivery lost on
    the way (injected: the 30th is dropped before the subscription sees it, as a connection
    that died with it in flight would) leaves a hole in the delivery sequence; the instance
    then acknowledges nothing past it and replaces its consumer by one that starts after the
    last event it acknowledged: every event is handled exactly once, the lost one included.
    A queue group's consumer keeps acknowledging each event."""
    from polyserve.shared import durable

    dropped: list[str] = []
    real = durable.DurableSubscription._on_msg

    async def lossy(self, m, gen=0):
        if not self.queue and gen == 0 and m.reply and durable._sequences(m.reply)[1] == 30 and not dropped:
            dropped.append(m.reply)
            return
        await real(self, m, gen)

    monkeypatch.setattr(durable.DurableSubscription, "_on_msg", lossy)
    run_dir = Path(tempfile.mkdtemp(prefix="ps-eva-", dir="/tmp"))
    proc, url, _ = infra.start_nats(run_dir / "nats")
    subjects = Subjects(f"eva{os.getpid()}")
    tracer, _ = make_tracer("t")
    pub, watch = await Bus.connect(url, tracer, "gateway"), await Bus.connect(url, tracer, "dispatcher")
    got: dict[str, list[str]] = {"all": [], "queue": []}

    def on(key: str):
        async def handler(ev) -> None:
            got[key].append(ev.request_id)
        return handler

    try:
        await watch.listen(subjects.event("completed"), Completed, on("all"))
        await watch.listen(subjects.event("completed"), Completed, on("queue"), queue="learn")
        plain, group = watch._durable
        assert plain.cumulative and not group.cumulative
        want = [f"r{i * 10}" for i in range(200)]
        for i in range(200):
            await pub.publish(subjects.event("completed"), _event(i * 10)[1])
        assert await _until(lambda: sorted(got["all"]) == sorted(want) and got["queue"] == want, 15), \
            (len(got["all"]), len(got["queue"]))
        assert dropped and plain.resyncs == 1, "the hole was noticed once"
        assert await _until(lambda: plain._last is None and plain._resync_task is None, 5.0)
        await asyncio.sleep(0.3)
        assert sorted(got["all"]) == sorted(want), "each event handled once (the re-read ones skipped)"
        jsm = watch.nc.jsm()
        for dsub in (plain, group):
            info = await jsm.consumer_info(dsub.stream, dsub.consumer)
            assert info.num_ack_pending == 0 and info.num_pending == 0, (dsub.consumer, info)
        assert group.acks == 200 and plain.acks <= 200 // durable.ACK_EVERY + 20, (group.acks, plain.acks)
        names = [c.name for c in await jsm.consumers_info(plain.stream)]
        assert plain.consumer in names and plain._name not in names, "the replaced consumer is gone"
    finally:
        for b in (pub, watch):
            await b.close()
        infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_delivery_numbers_are_read_from_both_reply_subject_formats():
    """`_sequences` reads (stream seq, delivery seq) from the reply subject with and without the
    domain and account hash; anything else gives (0, 0), and such an event is acknowledged alone
    (never a resync on a number it could not read)."""
    from polyserve.shared.durable import _sequences

    assert _sequences("$JS.ACK.st.cons.1.57.12.1700000000000000000.3") == (57, 12)
    assert _sequences("$JS.ACK.dom.hash.st.cons.2.57.12.17000.3.rnd") == (57, 12)
    assert _sequences("$JS.ACK.dom.hash.st.cons.2.57.12.17000.3") == (57, 12)
    for odd in ("_INBOX.a.b", "$JS.ACK.a.b.c.d.e.f.g", "$JS.ACK.st.cons.x.y.z.t.p", ""):
        assert _sequences(odd) == (0, 0)
