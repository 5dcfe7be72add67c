"""Dispatcher replicas: `polyserve up --dispatchers 2` runs two dispatcher processes in one
queue group (`dispatcher`, `dispatcher-2`); both register, requests are served, and the
supervisor restarts one that dies while the other keeps placing. (Their shared accounting
is tested in tests/integration/test_dispatcher_replicas.py.)"""
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


def _complete(url: str) -> int:
    body = {"model": "dp-sim", "prompt": "which dispatcher", "max_tokens": 2}
    return httpx.post(url + "/v1/completions", json=body, timeout=10).status_code


def test_two_dispatcher_replicas_serve_and_restart():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-dp2-"))
    spec = launcher.ClusterSpec(run_dir=run_dir, engine="sim", model="dp-sim", port=infra.free_port(),
                                nats_port=0, redis_port=0, min_replicas=1, max_replicas=1, dispatchers=2,
                                extra_env=dict(SYSTEM_ENV, POLYSERVE_WORKER_TIME_SCALE="0"), ready_timeout_s=60)
    state = launcher.up(spec, progress=lambda m: None)
    try:
        pids = [state.pids["dispatcher"], state.pids["dispatcher-2"]]
        r = redis.Redis.from_url(state.redis_url)

        def dispatchers() -> int:
            members = [m.decode() for m in r.zrangebyscore(Keys(state.prefix).services, time.time(), "+inf")]
            return len([m for m in members if m.startswith("dispatcher:")])

        wait_until(lambda: dispatchers() == 2, 15, what="two dispatcher instances registered")
        assert all(_complete(state.gateway_url) == 200 for _ in range(40))

        os.kill(pids[1], signal.SIGKILL)
        assert all(_complete(state.gateway_url) == 200 for _ in range(20))  # the other one places
        wait_until(lambda: (launcher.ClusterState.load(run_dir).restarts or {}).get("dispatcher-2", 0) >= 1,
                   30, what="the supervisor restarts dispatcher-2")
        assert launcher.ClusterState.load(run_dir).pids["dispatcher-2"] != pids[1]
        assert (run_dir / "logs" / "dispatcher-2.log").exists()
        wait_until(lambda: dispatchers() == 2, 15, what="the restarted dispatcher-2 registered")
    finally:
        launcher.down(run_dir, progress=lambda m: None)
        shutil.rmtree(run_dir, ignore_errors=True)
