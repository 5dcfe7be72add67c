"""Events of one subject published within a window travel as one message (shared/batching.py,
issue 15): a raw NATS subscriber sees one message per subject, holding a JSON array; every
`Bus.listen` handler still gets each event, in order, the terminal ones through JetStream; with
POLYSERVE_EVENT_BATCH_MS=0 each event is its own message again."""
from __future__ import annotations

import asyncio

import nats
import pytest

from polyserve.proto import Completed, Predicted
from polyserve.shared import batching
from polyserve.shared.bus import Bus
from polyserve.shared.telemetry import make_tracer
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def _completed(i: int) -> Completed:
    return Completed(request_id=f"r{i}", worker_id="w", input_tokens=1, output_tokens=2, e2e_ms=1.0, ttft_ms=1.0)


def _predicted(i: int) -> Predicted:
    return Predicted(request_id=f"r{i}", model="m", length_class=1, tokens_estimate=9, latency_ms=0.1,
                     source="history")


async def _publish_and_watch(url: str, subjects, pub: Bus, n: int) -> list[tuple[str, bytes]]:
    """Publish n `completed` and n `predicted` events interleaved (completed first) through
    `publish_soon`; what a raw subscriber of every request event saw, as (kind, payload)."""
    raw: list[tuple[str, bytes]] = []
    nc = await nats.connect(url)

    async def on(m) -> None:
        raw.append((m.subject.rsplit(".", 1)[-1], m.data))

    await nc.subscribe(subjects.event("*"), cb=on)
    await nc.flush()
    for i in range(n):
        pub.publish_soon(subjects.event("completed"), _completed(i))
        pub.publish_soon(subjects.event("predicted"), _predicted(i))
    await wait_for(lambda: sum(len(batching.event_dicts(d)) for _, d in raw) == 2 * n, what="every event")
    await nc.close()
    return raw


async def test_a_burst_is_one_message_per_subject_and_every_handler_gets_each_event(infra_servers, subjects):
    tracer, _ = make_tracer("t")
    pub = await Bus.connect(infra_servers.nats_url, tracer, "gateway")
    sub = await Bus.connect(infra_servers.nats_url, tracer, "dispatcher")
    done: list[str] = []
    pred: list[str] = []

    async def on_done(ev: Completed) -> None:
        if ev.request_id == "r2":
            raise RuntimeError("one handler call fails")
        done.append(ev.request_id)

    async def on_pred(ev: Predicted) -> None:
        pred.append(ev.request_id)

    try:
        await sub.listen(subjects.event("completed"), Completed, on_done)
        await sub.listen(subjects.event("predicted"), Predicted, on_pred)
        assert sub._durable, "the terminal events come through JetStream"
        await sub.nc.flush()
        raw = await _publish_and_watch(infra_servers.nats_url, subjects, pub, 6)
        assert [k for k, _ in raw] == ["predicted", "completed"], "one message per subject, terminal last"
        assert all(batching.is_batch(d) for _, d in raw)
        await wait_for(lambda: len(done) == 5 and len(pred) == 6, what="each event handled")
        assert pred == [f"r{i}" for i in range(6)]
        assert done == [f"r{i}" for i in range(6) if i != 2], "a failing event does not stop the rest"
        assert sub.errors == 1
        await wait_for(lambda: pub.outbox.pending == 0, what="the batch stored by JetStream")
        assert pub.outbox.acked == 1, "stored and acknowledged as one message"
    finally:
        await pub.close()
        await sub.close()


async def test_a_quiet_flow_sends_at_once_and_batch_ms_0_sends_one_message_per_event(infra_servers, subjects,
                                                                                     monkeypatch):
    tracer, _ = make_tracer("t")
    monkeypatch.setenv("POLYSERVE_EVENT_BATCH_MS", "0")
    pub = await Bus.connect(infra_servers.nats_url, tracer, "gateway")
    try:
        raw = await _publish_and_watch(infra_servers.nats_url, subjects, pub, 3)
        assert len(raw) == 6 and not any(batching.is_batch(d) for _, d in raw)
    finally:
        await pub.close()
    monkeypatch.delenv("POLYSERVE_EVENT_BATCH_MS")
    pub = await Bus.connect(infra_servers.nats_url, tracer, "gateway")
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        raw = await _publish_and_watch(infra_servers.nats_url, subjects, pub, 1)
        assert len(raw) == 2 and loop.time() - t0 < 1.0, "a lone event goes out at once (2 ms)"
    finally:
        await pub.close()


async def test_polyserve_events_prints_one_line_per_event_of_a_batch(infra_servers, subjects, tmp_path):
    """`polyserve events` (the CLI, as a process) prints each event of a batch message on its own line."""
    import json
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "polyserve.cli", "--run-dir", str(tmp_path), "events",
                             "--server", infra_servers.nats_url, "--subject", subjects.event("*"),
                             "--count", "3", "--seconds", "20"], stdout=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    tracer, _ = make_tracer("t")
    pub = await Bus.connect(infra_servers.nats_url, tracer, "gateway")
    try:
        first = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline), 20)
        assert "listening on" in first, first
        await asyncio.sleep(0.3)  # its SUB reaches nats-server
        for i in range(3):
            pub.publish_soon(subjects.event("predicted"), _predicted(i))
        out, _ = await asyncio.wait_for(loop.run_in_executor(None, proc.communicate), 25)
    finally:
        await pub.close()
        if proc.poll() is None:
            proc.kill()
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert [json.loads(ln.split("] ", 1)[1])["request_id"] for ln in lines] == ["r0", "r1", "r2"]
