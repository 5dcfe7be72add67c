"""System tier: nats-server, redis-server and the six services as processes,
started by `polyserve up`'s code, driven with the official openai client."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import nats
import openai
import pytest

from polyserve.cli.status import cluster_status
from polyserve.shared import batching
from tests.helpers import assert_lifecycle, wait_until

pytestmark = pytest.mark.system


class EventLog:
    """Collects every event of the cluster in a background thread."""

    def __init__(self, url: str, prefix: str):
        import asyncio

        self.events: list[dict] = []
        self.changed = threading.Condition()  # notified on every event: `wait` needs no polling
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def main():
            self.nc = await nats.connect(url)
            await self.nc.subscribe(f"{prefix}.v1.events.>", cb=self._on)
            await self.nc.subscribe(f"{prefix}.v1.telemetry.>", cb=self._on)
            await self.nc.flush()
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(main(), self._loop)
        ready.wait(10)

    async def _on(self, msg):
        got = batching.event_dicts(msg.data)  # one event or several in one message
        with self.changed:
            self.events.extend(got)
            self.changed.notify_all()

    def wait(self, pred, timeout=20.0, what="condition"):
        """Until `pred()` (which reads the events) is truthy; woken by each event."""
        return wait_until(pred, timeout, what=what, changed=self.changed)

    def of(self, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e.get("event") == kind]

    def close(self):
        import asyncio

        asyncio.run_coroutine_threadsafe(self.nc.drain(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture(scope="module")
def events(cluster):
    log = EventLog(cluster.nats_url, cluster.prefix)
    yield log
    log.close()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_up_reports_every_service_and_status_shows_them(cluster):
    assert any("gateway ready" in line for line in cluster.progress)
    st = cluster_status(cluster)
    names = {s["service"] for s in st["services"]}
    assert {"gateway", "predictor", "dispatcher", "planner", "gpu-agent", "worker"} <= names
    assert len(st["workers"]) == 1 and st["workers"][0]["simulated"] is True
    assert st["gpus"] and st["gpus"][0]["simulated"] is True
    out = subprocess.run([sys.executable, "-m", "polyserve.cli", "--run-dir", cluster.run_dir, "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "gateway" in out.stdout and "simulated" in out.stdout


def test_openai_client_and_events(cluster, client, events):
    models = client.models.list()
    assert [m.id for m in models.data] == ["sys-sim"]
    c = client.completions.create(model="sys-sim", prompt="hello", max_tokens=4)
    assert c.choices[0].text
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="sys-sim", stream=True, max_tokens=4, messages=[{"role": "user", "content": "hi"}]) if ch.choices)
    assert text
    events.wait(lambda: any(e["request_id"] == c.id for e in events.of("completed")), what="completed event")
    kinds = [e["event"] for e in list(events.events) if e.get("request_id") == c.id]
    assert_lifecycle(kinds)
    assert set(kinds) == {"admitted", "predicted", "dispatched", "first_token", "completed"}
    events.wait(lambda: events.of("heartbeat") and events.of("gpu"), what="heartbeat and gpu telemetry")
    assert all(g["simulated"] for g in events.of("gpu"))


def test_events_since_prints_the_stored_terminal_events_as_the_operator(cluster, client, events):
    """`polyserve events --since` (a process, as the operator's NATS user: it may publish only
    JetStream's read-only lookups on the event stream) prints the completed events of requests
    that ended before it started, from the stream, oldest first, then goes on live."""
    ids = [client.completions.create(model="sys-sim", prompt=f"hello {i}", max_tokens=3).id for i in range(3)]
    events.wait(lambda: {e["request_id"] for e in events.of("completed")} >= set(ids), what="completed events")
    time.sleep(0.5)  # the gateway's outbox: stored once the stream acknowledges
    out = subprocess.run([sys.executable, "-m", "polyserve.cli", "--run-dir", cluster.run_dir, "events",
                          "--since", "10m", "--seconds", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stored = out.stdout.split("listening on", 1)[0]
    assert "no stored events" not in stored, out.stdout
    seen = [i for i in ids if i in stored]
    assert seen == ids and stored.index(ids[0]) < stored.index(ids[2]), stored[-2000:]
    assert all(line.startswith(f"[{cluster.prefix}.v1.events.request.") for line in stored.splitlines() if line)
    recent = subprocess.run([sys.executable, "-m", "polyserve.cli", "--run-dir", cluster.run_dir, "events",
                             "--since", "1s", "--count", "1", "--seconds", "2"], capture_output=True, text=True,
                            timeout=60)
    assert ids[0] not in recent.stdout.split("listening on", 1)[0]  # older than the span: not shown
    bad = subprocess.run([sys.executable, "-m", "polyserve.cli", "--run-dir", cluster.run_dir, "events",
                          "--since", "soon"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "15m" in bad.stdout


def test_worker_killed_mid_stream_fails_fast_and_is_not_placed_on(cluster, client, events):
    st = cluster_status(cluster)
    victim = st["workers"][0]["worker_id"]
    pid = next(s["pid"] for s in st["services"] if s["service"] == "worker")
    stream = client.completions.create(model="sys-sim", prompt="long", max_tokens=3000, stream=True,
                                       extra_body={"min_tokens": 3000})
    got = 0
    t_kill = None
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            got += 1
            if got == 5:
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()
    assert time.monotonic() - t_kill < 5, "the client must get an error, not a hang"
    assert victim in str(err.value) or "failed" in str(err.value)
    events.wait(lambda: any(e["worker_id"] == victim and "code -9" in e["reason"] or "-9" in e["reason"]
                            for e in events.of("worker_down")), what="worker_down with the exit code")
    failed = events.wait(lambda: [e for e in events.of("failed") if e.get("worker_id") == victim],
                         what="failed event")
    assert failed[0]["reason"]
    # the planner replaces it; no request is ever placed on the dead worker again
    t_dead = time.monotonic()
    ok = wait_until(lambda: _try(client), timeout=30, interval=0.1,  # HTTP retries: polled
                    what="a replacement worker serving")
    assert ok
    since = time.time() - (time.monotonic() - t_dead)
    # events leave the gateway up to a batch window after the answer (shared/batching.py): wait for them
    later = events.wait(lambda: [e for e in events.of("dispatched") if e["ts"] > since],
                        what="the dispatched events of the requests after the kill")
    assert all(e["worker_id"] != victim for e in later)


def _try(client):
    try:
        return client.completions.create(model="sys-sim", prompt="again", max_tokens=2).choices[0].text
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
        return None
