"""System tier: the attacks of issue 14 against a real `polyserve up` (sim engine, its own
run dir and free ports), each refused: anonymous NATS and Redis, a service's credentials
used beyond its permissions, a StartWorker whose `extra_env` would run a shell command in
the worker, the admin API without its key, a gateway exposed without an admin key."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import nats
import openai
import pytest
import redis

from polyserve.cli import launcher
from polyserve.cli.status import cluster_status
from polyserve.proto import AgentReply, Keys, StartWorker, Subjects
from polyserve.shared import auth, infra
from polyserve.shared.bus import Bus, BusError
from polyserve.shared.telemetry import make_tracer
from tests.system.conftest import SYSTEM_ENV

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def secured():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-sec-"))
    spec = launcher.ClusterSpec(run_dir=run_dir / "run", engine="sim", model="sec-sim", port=infra.free_port(),
                                nats_port=0, redis_port=0, min_replicas=1, max_replicas=1,
                                extra_env=SYSTEM_ENV, ready_timeout_s=60)
    state = launcher.up(spec, progress=lambda m: None)
    yield state
    launcher.down(spec.run_dir, progress=lambda m: None)
    shutil.rmtree(run_dir, ignore_errors=True)


def _secrets(state) -> auth.Secrets:
    sec = auth.Secrets.load(Path(state.run_dir, "secrets", "credentials.json"))
    assert sec is not None
    return sec


def _url(state, user: str) -> str:
    return auth.with_userinfo(auth.strip_userinfo(state.nats_url), user, _secrets(state).nats[user])


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_secrets_are_owner_only(secured):
    sdir = Path(secured.run_dir, "secrets")
    assert _mode(secured.run_dir) == 0o700 and _mode(sdir) == 0o700
    for name in ("credentials.json", "nats.conf", "redis.conf", "admin.key"):
        assert _mode(sdir / name) == 0o600, name
    assert _mode(Path(secured.run_dir, "state.json")) == 0o600
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in secured.pids.values() if infra.pid_alive(pid)]
    for password in [*_secrets(secured).nats.values(), *_secrets(secured).redis.values()]:
        assert not any(password.encode() in c for c in cmdlines), "a password is visible in a command line"


def test_unauthenticated_nats_is_refused(secured):
    async def attempt():
        nc = await nats.connect(auth.strip_userinfo(secured.nats_url), allow_reconnect=False,
                                max_reconnect_attempts=0, connect_timeout=2)
        await nc.close()

    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(asyncio.wait_for(attempt(), 10))


def test_service_credentials_cannot_read_inboxes_or_start_workers(secured):
    gpu = cluster_status(secured)["gpus"][0]["gpu_id"]
    start = Subjects(secured.prefix).agent(gpu, "start")
    req = msgspec.json.encode(StartWorker(deployment="sec-sim", model="sec-sim", engine="sim"))

    async def attempt(user: str) -> tuple[list[str], list]:
        errors: list[str] = []
        got: list = []

        async def on_error(exc):
            errors.append(str(exc))

        async def on_msg(msg):
            got.append(msg)

        nc = await nats.connect(_url(secured, user), error_cb=on_error, allow_reconnect=False,
                                inbox_prefix=auth.inbox_prefix(user), connect_timeout=2)
        await nc.subscribe(f"{auth.inbox_prefix('gateway')}.>", cb=on_msg)
        await nc.publish(start, req)
        await nc.flush()
        deadline = time.monotonic() + 5
        while len(errors) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await nc.close()
        return errors, got

    for user in ("worker", "dispatcher", "gateway"):
        errors, got = asyncio.run(attempt(user))
        text = " ".join(errors).lower()
        assert f"publish to \"{start.lower()}\"" in text, (user, errors)
        if user != "gateway":  # the gateway may read its own inboxes, nobody else
            assert "subscription to \"_inbox.gateway.>\"" in text, (user, errors)
        assert not got


def test_unauthenticated_redis_is_refused(secured):
    anonymous = redis.Redis.from_url(auth.strip_userinfo(secured.redis_url), socket_timeout=2)
    with pytest.raises(redis.RedisError):
        anonymous.ping()
    worker = redis.Redis.from_url(auth.with_userinfo(auth.strip_userinfo(secured.redis_url), "worker",
                                                     _secrets(secured).redis["worker"]), socket_timeout=2)
    assert worker.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.config_set("dir", "/tmp")  # the classic Redis-to-file write
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.set("elsewhere:key", "1")


def test_start_worker_env_injection_is_refused(secured, tmp_path):
    """The tester's trick: PYTHONWARNINGS imports `antigravity`, which opens $BROWSER (a shell command)."""
    marker = tmp_path / "pwned"
    gpu = cluster_status(secured)["gpus"][0]["gpu_id"]
    r = redis.Redis.from_url(secured.redis_url, socket_timeout=2)
    keys, subjects = Keys(secured.prefix), Subjects(secured.prefix)
    workers_before = json.loads(r.get(keys.agent(gpu)))["workers"]
    bad = {"PYTHONWARNINGS": "all:0:antigravity.x:0:0", "BROWSER": f"/bin/sh -c 'touch {marker}' #%s"}

    async def attempt():
        events: list[dict] = []
        watcher = await nats.connect(secured.nats_url, allow_reconnect=False, connect_timeout=2)

        async def on_refused(msg):
            events.append(json.loads(msg.data))

        await watcher.subscribe(subjects.service_event("refused"), cb=on_refused)
        await watcher.flush()
        bus = await Bus.connect(_url(secured, "planner"), make_tracer("sec")[0], "planner")
        try:
            with pytest.raises(BusError) as err:
                await bus.request(subjects.agent(gpu, "start"), StartWorker(
                    deployment="sec-sim", model="sec-sim", engine="sim", extra_env=bad), AgentReply, timeout=5)
            deadline = time.monotonic() + 5
            while not events and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await bus.close()
            await watcher.close()
        return err.value, events

    err, events = asyncio.run(attempt())
    assert err.code == 400 and "PYTHONWARNINGS" in err.description and "BROWSER" in err.description
    assert "antigravity" not in err.description and "touch" not in err.description  # names, never values
    assert events and events[0]["event"] == "refused" and set(events[0]["keys"]) == {"PYTHONWARNINGS", "BROWSER"}
    time.sleep(1.0)
    assert not marker.exists()
    assert json.loads(r.get(keys.agent(gpu)))["workers"] == workers_before


def test_admin_api_needs_the_key_and_openai_client_works_on_loopback(secured):
    url = secured.gateway_url + "/v1/deployments"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code in (401, 403)
    key = launcher.read_admin_key(Path(secured.run_dir))
    assert key and Path(secured.admin_key_file).read_text().strip() == key
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and "sec-sim" in resp.read().decode()
    client = openai.OpenAI(base_url=secured.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert client.completions.create(model="sec-sim", prompt="hello", max_tokens=4).choices[0].text


def _admin_post(state, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(state.gateway_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {launcher.read_admin_key(Path(state.run_dir))}",
                                          "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_huge_deployment_and_adapters_outside_the_roots_are_refused(secured, tmp_path):
    """min = max = 10^9 is a 400 naming the field (the planner would clamp it anyway); `up` allows
    adapters only under $POLYSERVE_HOME/adapters, and the 400 shows no file content."""
    status, body = _admin_post(secured, "/v1/deployments", {"id": "huge", "model": "m", "engine": "sim", "scaler": {
        "min_replicas": 10**9, "max_replicas": 10**9}})
    assert status == 400 and body["error"]["param"] == "scaler.max_replicas", body
    adapter = tmp_path / "a8"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": "SECRET-value"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    status, body = _admin_post(secured, "/v1/adapters", {"name": "a8", "path": str(adapter), "deployment": "sec-sim"})
    assert status == 400 and "outside the adapter roots" in body["error"]["message"], body
    assert str(launcher.default_run_dir().parent / "adapters") in body["error"]["message"]
    assert "SECRET" not in json.dumps(body)


def test_gateway_beyond_loopback_without_admin_key_refuses_to_start(tmp_path):
    env = dict(os.environ, POLYSERVE_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "polyserve.cli", "up", "--engine", "sim", "--host", "0.0.0.0",
                          "--port", str(infra.free_port()), "--no-admin-key", "--timeout", "20"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0 and "--insecure" in out.stdout, out.stdout + out.stderr
    assert not (tmp_path / "run" / "state.json").exists()  # nothing was started
