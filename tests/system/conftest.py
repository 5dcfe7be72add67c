"""A whole polyserve started as processes by the same code as `polyserve up`."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from polyserve.cli import launcher
from polyserve.shared import infra

SYSTEM_ENV = {
    "POLYSERVE_WORKER_TIME_SCALE": "0.05",  # sim engine at 1/20 of the profiled GPU time
    "POLYSERVE_WORKER_HEARTBEAT_INTERVAL_S": "0.3",
    "POLYSERVE_WORKER_HEARTBEAT_TTL_S": "1.5",
    "POLYSERVE_PLANNER_POLL_INTERVAL_S": "1.0",
    "POLYSERVE_DRAIN_TIMEOUT_S": "5",
    "POLYSERVE_SERVICE_TTL_S": "3",
}


@pytest.fixture(scope="module")
def cluster():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-sys-"))
    spec = launcher.ClusterSpec(run_dir=run_dir, engine="sim", model="sys-sim", port=infra.free_port(),
                                nats_port=0, redis_port=0, min_replicas=1, max_replicas=1,
                                extra_env=SYSTEM_ENV, ready_timeout_s=60)
    lines: list[str] = []
    state = launcher.up(spec, progress=lines.append)
    state.progress = lines  # type: ignore[attr-defined]
    yield state
    launcher.down(run_dir, progress=lambda m: None)
    shutil.rmtree(run_dir, ignore_errors=True)
