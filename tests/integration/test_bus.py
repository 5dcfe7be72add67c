
import asyncio
import os
import signal

import pytest

from polyserve.proto import Prediction, PredictRequest
from polyserve.shared import infra
from polyserve.shared.bus import Bus, BusError
from polyserve.shared.telemetry import make_tracer

pytestmark = pytest.mark.integration


async def test_request_reply_errors_and_trace_propagation(infra_servers, subjects, span_exporter):
    tracer, _ = make_tracer("srv", exporter=span_exporter)
    server = await Bus.connect(infra_servers.nats_url, tracer, "srv")
    ctracer, _ = make_tracer("cli", exporter=span_exporter)
    client = await Bus.connect(infra_servers.nats_url, ctracer, "cli")

    async def handler(req: PredictRequest) -> Prediction:
        if req.input_tokens < 0:
            raise BusError(400, "input_tokens must be >= 0")
        if req.input_tokens == 999:
            raise RuntimeError("boom")
        return Prediction(request_id=req.request_id, model=req.model, length_class=1,
                          tokens_estimate=req.input_tokens * 2, source="prior")

    await server.serve(subjects.predict, PredictRequest, handler)
    await server.nc.flush()
    ok = await client.request(subjects.predict, PredictRequest(request_id="r", model="m", input_tokens=3),
                              Prediction, timeout=2)
    assert ok.tokens_estimate == 6
    with pytest.raises(BusError) as err:
        await client.request(subjects.predict, PredictRequest(request_id="r", model="m", input_tokens=-1),
                             Prediction, timeout=2)
    assert err.value.code == 400 and "input_tokens" in err.value.description
    with pytest.raises(BusError) as err:
        await client.request(subjects.predict, PredictRequest(request_id="r", model="m", input_tokens=999),
                             Prediction, timeout=2)
    assert err.value.code == 500 and "boom" in err.value.description
    with pytest.raises(BusError) as err:  # malformed payload
        await client.request(subjects.predict, {"request_id": 5}, Prediction, timeout=2)
    assert err.value.code == 400
    with pytest.raises(BusError) as err:  # nobody listening
        await client.request(subjects.dispatch, PredictRequest(request_id="r", model="m", input_tokens=1),
                             Prediction, timeout=1)
    assert err.value.code == 503
    spans = span_exporter.get_finished_spans()
    client_span = [s for s in spans if s.kind.name == "CLIENT"][0]
    server_span = [s for s in spans if s.kind.name == "SERVER"][0]
    assert server_span.context.trace_id == client_span.context.trace_id
    assert server_span.parent.span_id == client_span.context.span_id
    await server.close()
    await client.close()


async def test_ping_through_a_paused_nats_server_keeps_the_connection_reading(tmp_path):
    """A PING unanswered while nats-server is stopped (SIGSTOP) says "not healthy" in time and,
    once the server runs again, the connection still delivers messages. nats-py's own
    flush(timeout) cancels its PONG future on the timeout and the late PONG ends the client's
    read loop (Bus.ping); the gateway's health probe did that during the chaos nats-pause
    scenario and lost every request in flight."""
    proc, url, _ = infra.start_nats(tmp_path / "nats")
    tracer, _ = make_tracer("t")
    sub = pub = None
    try:
        sub, pub = await Bus.connect(url, tracer, "sub"), await Bus.connect(url, tracer, "pub")
        got: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg) -> None:
            await got.put(msg.data)

        await sub.nc.subscribe("t.paused", cb=on_msg)
        await sub.sync(timeout=5)
        assert await sub.ping(timeout=2)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await _stopped(proc.pid)
            # the stopped server does not answer; the caller stops waiting at its timeout (the
            # outer bound only turns a ping that waits for the PONG into a failure, not a hang)
            assert not await asyncio.wait_for(sub.ping(timeout=0.3), 10)
            assert not await asyncio.wait_for(sub.ping(timeout=0.3), 10)  # the same PING, still waited for
            await asyncio.sleep(1.0)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert await sub.ping(timeout=5)  # the late PONG answers the PING in flight
        for i in range(3):
            await pub.nc.publish("t.paused", str(i).encode())
        await pub.sync(timeout=5)
        # the reading side of the connection survived the late PONG
        assert [await asyncio.wait_for(got.get(), 3) for _ in range(3)] == [b"0", b"1", b"2"]
        assert sub.nc.stats.get("reconnects", 0) == 0
    finally:
        for bus in (sub, pub):
            if bus is not None:
                await bus.close()
        proc.kill()
        proc.wait(10)


async def _stopped(pid: int, timeout: float = 5.0) -> None:
    """Until `pid` is stopped: kill() returns before the signal takes effect, and a running
    nats-server can still answer one more PING in between."""
    def state(path: str) -> str:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    for _ in range(int(timeout / 0.01)):  # every thread of it (nats-server is a Go program)
        if all(state(f"/proc/{pid}/task/{tid}/stat") == "T" for tid in os.listdir(f"/proc/{pid}/task")):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout}s")
