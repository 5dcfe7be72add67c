"""Gateway scale-out: `polyserve up --gateways 2` runs two gateway processes on one port
(SO_REUSEPORT); both serve, each registers as its own instance, and the supervisor restarts
one that dies while the other keeps serving."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import redis

from polyserve.cli import launcher
from polyserve.proto import Keys
from polyserve.shared import infra
from tests.helpers import wait_until
from tests.system.conftest import SYSTEM_ENV

pytestmark = pytest.mark.system


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _complete(url: str) -> int:
    """One completion on a fresh connection (so the kernel picks a gateway each time)."""
    body = {"model": "gw-sim", "prompt": "which gateway", "max_tokens": 2}
    for attempt in range(3):
        try:
            return httpx.post(url + "/v1/completions", json=body, timeout=10).status_code
        except httpx.TransportError:  # a connection queued at a gateway that was just killed
            if attempt == 2:
                raise
            time.sleep(0.2)
    return 0


@pytest.mark.skipif(not hasattr(__import__("socket"), "SO_REUSEPORT"), reason="needs SO_REUSEPORT")
def test_two_gateway_processes_serve_one_port_and_restart():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-gw2-"))
    spec = launcher.ClusterSpec(run_dir=run_dir, engine="sim", model="gw-sim", port=infra.free_port(),
                                nats_port=0, redis_port=0, min_replicas=1, max_replicas=1, gateways=2,
                                extra_env=dict(SYSTEM_ENV, POLYSERVE_WORKER_TIME_SCALE="0"), ready_timeout_s=60)
    state = launcher.up(spec, progress=lambda m: None)
    try:
        pids = [state.pids["gateway"], state.pids["gateway-2"]]
        r = redis.Redis.from_url(state.redis_url)
        members = [m.decode() for m in r.zrangebyscore(Keys(state.prefix).services, time.time(), "+inf")]
        assert len([m for m in members if m.startswith("gateway:")]) == 2  # two instances, one name

        before = [_cpu_s(p) for p in pids]
        assert all(_complete(state.gateway_url) == 200 for _ in range(150))
        used = [_cpu_s(p) - b for p, b in zip(pids, before)]
        assert min(used) > 0.03, f"one gateway process served nothing: CPU seconds used {used}"

        os.kill(pids[1], signal.SIGKILL)
        assert all(_complete(state.gateway_url) == 200 for _ in range(20))  # the other one serves
        wait_until(lambda: (launcher.ClusterState.load(run_dir).restarts or {}).get("gateway-2", 0) >= 1,
                   30, what="the supervisor restarts gateway-2")
        assert launcher.ClusterState.load(run_dir).pids["gateway-2"] != pids[1]
        assert (run_dir / "logs" / "gateway-2.log").exists()
    finally:
        launcher.down(run_dir, progress=lambda m: None)
        shutil.rmtree(run_dir, ignore_errors=True)
