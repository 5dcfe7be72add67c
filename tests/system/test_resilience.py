"""Issue 13, faults injected into the real processes `polyserve up` starts (sim engine):
services SIGKILLed are restarted by the supervisor, Redis SIGKILLed comes back with its
data (append-only file), Redis emptied gets the `--config` desired state again, and no
worker is stopped as an orphan on the way. Every wait is bounded; serving must resume
within 10 s with no action."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
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

RECOVERY_S = 10.0
CONFIG = """\
deployments:
  - id: chaos
    model: chaos-sim
    engine: sim
    scaler:
      min_replicas: 1
      max_replicas: 1
"""


@pytest.fixture(scope="module")
def cluster():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-chaos-"))
    config = run_dir / "desired.yaml"
    config.write_text(CONFIG)
    spec = launcher.ClusterSpec(run_dir=run_dir / "run", engine="sim", port=infra.free_port(), nats_port=0,
                                redis_port=0, extra_env=SYSTEM_ENV, ready_timeout_s=60,
                                config_file=str(config))
    state = launcher.up(spec, progress=lambda m: None)
    yield state
    launcher.down(spec.run_dir, progress=lambda m: None)
    shutil.rmtree(run_dir, ignore_errors=True)


def _ok(state) -> bool:
    try:
        resp = httpx.post(f"{state.gateway_url}/v1/completions", timeout=5,
                          json={"model": "chaos", "prompt": "still there?", "max_tokens": 2})
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def _serving_again(state, since: float) -> float:
    """Seconds from `since` until a request succeeds; fails past RECOVERY_S."""
    wait_until(lambda: _ok(state), timeout=RECOVERY_S - (time.monotonic() - since), interval=0.1,
               what="serving to resume")
    return time.monotonic() - since


def _state(state) -> launcher.ClusterState:
    return launcher.ClusterState.load(Path(state.run_dir))


def _r(state) -> redis.Redis:
    return redis.Redis.from_url(_state(state).redis_url, socket_timeout=2)


def _workers(state) -> set[str]:
    r, keys = _r(state), Keys(state.prefix)
    return {m.decode() for m in r.zrangebyscore(keys.workers, time.time(), "+inf")}


def test_up_applies_the_config_and_hands_over_to_the_supervisor(cluster):
    assert _ok(cluster)
    st = _state(cluster)
    assert infra.pid_alive(st.pids["supervisor"]) and st.restarts == {}
    assert _r(cluster).exists(Keys(cluster.prefix).deployment("chaos"))
    assert oct(os.stat(Path(st.run_dir) / "redis").st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("victim", ["predictor", "dispatcher"])
def test_killed_service_is_restarted_and_serving_resumes(cluster, victim):
    before = _state(cluster)
    os.kill(before.pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: _state(cluster).restarts.get(victim) == before.restarts.get(victim, 0) + 1,
               timeout=5, what=f"the supervisor restarting {victim}")
    after = _state(cluster)
    assert after.pids[victim] != before.pids[victim] and infra.pid_alive(after.pids[victim])
    _serving_again(cluster, t0)
    out = subprocess.run([sys.executable, "-m", "polyserve.cli", "--run-dir", cluster.run_dir, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f'"restarts": {after.restarts[victim]}' in out.stdout
    prom = (Path(cluster.run_dir) / "supervisor.prom").read_text()
    assert f'polyserve_process_restarts_total{{process="{victim}"}} {after.restarts[victim]}' in prom


def test_redis_sigkill_keeps_deployments_and_workers(cluster):
    workers = _workers(cluster)
    assert workers
    os.kill(_state(cluster).pids["redis-server"], signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: _state(cluster).restarts.get("redis-server") == 1, timeout=5,
               what="the supervisor restarting redis-server")
    _serving_again(cluster, t0)
    assert _r(cluster).exists(Keys(cluster.prefix).deployment("chaos")), "the deployment survived (AOF)"
    wait_until(lambda: workers <= _workers(cluster), timeout=5, what="the same workers registered again")
    log = (Path(cluster.run_dir) / "logs" / "planner.log").read_text()
    assert "stopping its" not in log, "the planner stopped workers as orphans"


def test_redis_data_loss_reapplies_the_config(cluster):
    workers = _workers(cluster)
    r, keys = _r(cluster), Keys(cluster.prefix)
    r.flushall()
    t0 = time.monotonic()
    wait_until(lambda: r.exists(keys.deployment("chaos")), timeout=RECOVERY_S, interval=0.1,
               what="the desired state re-applied")
    _serving_again(cluster, t0)
    wait_until(lambda: workers <= _workers(cluster), timeout=5, what="the same workers registered again")
    log = (Path(cluster.run_dir) / "logs" / "planner.log").read_text()
    assert "stopping its" not in log, "the planner stopped workers as orphans"


def test_down_stops_the_supervisor_first(cluster):
    st = _state(cluster)
    lines: list[str] = []
    assert launcher.down(Path(cluster.run_dir), progress=lines.append)
    assert lines[0].startswith("stopped the supervisor")
    assert not any(infra.pid_alive(p) for p in st.pids.values())  # the supervisor too: nothing comes back
    assert not (Path(cluster.run_dir) / "state.json").exists()
