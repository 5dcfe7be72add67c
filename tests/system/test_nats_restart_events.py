"""Issue 13: nats-server (one, as `polyserve up` starts it) SIGKILLed while streams run and
restarted by the supervisor on the same port and JetStream store: every request still has
its terminal event (`completed` or `failed`) in the event stream, and no stream is silently
short. Before the JetStream stream (shared/durable.py), `completed` events went over core
NATS and some never arrived."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from polyserve.cli import launcher
from polyserve.shared import infra
from tests.helpers import wait_until
from tests.system.conftest import SYSTEM_ENV
from tests.system.test_ha_topology import STREAMS, _state, _stream, _terminal_events

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def single():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-nre-"))
    spec = launcher.ClusterSpec(run_dir=run_dir / "run", engine="sim", model="ha-sim", port=infra.free_port(),
                                nats_port=0, redis_port=0, min_replicas=2, max_replicas=2,
                                extra_env=SYSTEM_ENV, ready_timeout_s=90)
    state = launcher.up(spec, progress=lambda m: None)
    yield state
    launcher.down(spec.run_dir, progress=lambda m: None)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_nats_server_killed_under_load_every_request_keeps_its_terminal_event(single):
    st = _state(single)
    since = datetime.now(timezone.utc) - timedelta(seconds=1)

    async def load() -> list[dict]:
        async with httpx.AsyncClient() as client:
            for _ in range(4):  # warm caches
                await _stream(client, st.gateway_url)
            tasks = [asyncio.create_task(_stream(client, st.gateway_url)) for _ in range(STREAMS)]
            await asyncio.sleep(0.4)  # mid-load
            os.kill(st.pids["nats-server"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(load())
    wait_until(lambda: _state(single).restarts.get("nats-server") == 1, timeout=10, what="nats-server restarted")
    ends = {e: sum(1 for r in results if r["end"] == e) for e in {r["end"] for r in results}}
    short = [r for r in results if r["end"] == "done" and (not r["usage"]
                                                           or r["chunks"] != r["usage"]["completion_tokens"])]
    assert not short, f"silently short streams: {short[:3]}"
    assert ends.get("hung", 0) == 0, ends
    ids = {r["id"] for r in results if r["id"]}
    seen = asyncio.run(_terminal_events(st, since, ids, timeout=25, replicas=1))
    missing = ids - set(seen)
    print(f"nats-server SIGKILLed under {STREAMS} streams and restarted: {ends}; "
          f"terminal events for {len(ids & set(seen))}/{len(ids)} requests")
    assert not missing, f"{len(missing)} of {len(ids)} requests without a terminal event"
