"""SIGTERM to any service: it stops taking work, finishes in-flight work within its
drain timeout and exits 0. Services run as processes on the session's servers."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest
import redis

from polyserve.proto import Deployment, Keys, ScalerPolicy
from polyserve.shared import infra
from tests.fakes import FAKE_WORKER_PROC
from tests.helpers import wait_until

pytestmark = pytest.mark.system


def start(name: str, env: dict, log_dir) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", f"polyserve.{name}"], env=env, stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL)


def wait_registered(r: redis.Redis, keys: Keys, service: str, proc: subprocess.Popen, timeout=30):
    """Until `service` is in the live set (Redis cannot notify: polled); fails at once if it exited."""

    def registered():
        assert proc.poll() is None, f"{service} exited with {proc.returncode}"
        return any(m.decode().startswith(service + ":") for m in r.zrangebyscore(keys.services, time.time(), "+inf"))

    wait_until(registered, timeout, what=f"{service} ready")


def wait_worker(r: redis.Redis, keys: Keys, timeout=10):
    """Until a worker's heartbeat is registered (the dispatcher has seen it too)."""
    wait_until(lambda: r.zcount(keys.workers, time.time(), "+inf"), timeout, what="a worker registered")


@pytest.fixture
def env(infra_servers, prefix):
    e = dict(os.environ, POLYSERVE_NATS_URL=infra_servers.nats_url, POLYSERVE_REDIS_URL=infra_servers.redis_url,
             POLYSERVE_PREFIX=prefix, POLYSERVE_DRAIN_TIMEOUT_S="8", POLYSERVE_WORKER_DEPLOYMENT="m",
             POLYSERVE_WORKER_MODEL="m", POLYSERVE_WORKER_ENGINE="sim", POLYSERVE_WORKER_TIME_SCALE="0.5",
             POLYSERVE_GPU_AGENT_WORKER_CMD=shlex.join([sys.executable, str(FAKE_WORKER_PROC)]))
    r = redis.Redis.from_url(infra_servers.redis_url)
    keys = Keys(prefix)
    dep = Deployment(id="m", model="m", engine="sim", scaler=ScalerPolicy(min_replicas=0, max_replicas=1))
    r.set(keys.deployment("m"), msgspec.json.encode(dep))
    r.sadd(keys.deployments, "m")
    return e, r, keys


@pytest.mark.parametrize("service", ["predictor", "dispatcher", "planner", "gpu_agent", "worker", "gateway"])
def test_sigterm_idle_service_exits_zero(service, env, tmp_path):
    e, r, keys = env
    e = dict(e, POLYSERVE_GATEWAY_PORT=str(infra.free_port()))
    proc = start(service, e, tmp_path)
    wait_registered(r, keys, service.replace("_", "-"), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, (tmp_path / f"{service}.log").read_text()[-2000:]
    assert not [m for m in r.zrange(keys.services, 0, -1) if m.decode().startswith(service.replace("_", "-"))]


def test_sigterm_gateway_and_worker_finish_in_flight_streams(env, tmp_path):
    e, r, keys = env
    port = infra.free_port()
    e = dict(e, POLYSERVE_GATEWAY_PORT=str(port))
    procs = {name: start(name, e, tmp_path) for name in ("predictor", "dispatcher", "worker", "gateway")}
    try:
        for name, proc in procs.items():
            wait_registered(r, keys, name, proc)
        wait_worker(r, keys)

        got_line = threading.Condition()  # notified on every streamed line

        def stream(out: list):
            body = {"model": "m", "prompt": "drain me", "max_tokens": 40, "min_tokens": 40, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        with got_line:
                            out.append(line)
                            got_line.notify_all()

        for victim in ("worker", "gateway"):
            lines: list[str] = []
            t = threading.Thread(target=stream, args=(lines,))
            t.start()
            with got_line:  # the stream is under way (at most 10 s; the assert below says if it ended)
                got_line.wait_for(lambda lines=lines: len(lines) >= 3, timeout=10)
            assert not any('"finish_reason":"length"' in x for x in lines), "stream finished too soon to test"
            procs[victim].send_signal(signal.SIGTERM)
            t.join(30)
            assert lines[-1] == "data: [DONE]", lines[-3:]
            assert any('"finish_reason":"length"' in x for x in lines), f"{victim} cut the stream short"
            assert procs[victim].wait(20) == 0
            if victim == "worker":  # a fresh worker for the gateway round
                procs["worker"] = start("worker", e, tmp_path)
                wait_registered(r, keys, "worker", procs["worker"])
                wait_worker(r, keys)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
