"""The Kubernetes NATS credentials on a real nats-server (issue 14): the ConfigMap's nats.conf of
infra/k8s/nats.yaml, laid out as the StatefulSet mounts it (/etc/nats/nats.conf including
/etc/nats-auth/auth.conf from the Secret `polyserve credentials k8s` writes), with only what a pod
provides changed for this host (the pid file and cluster port; client port, monitor port and
JetStream store directory come from the command line; the cluster routes stay and retry). Each service connects as its own user with the
password its Deployment reads; anonymous and cross-user logins are refused; and a service is
refused the subjects it must not use: only the planner may send StartWorker, only the gateway
may read the gateway's reply inboxes."""
from __future__ import annotations

import asyncio
import contextlib
import re
import time

import nats
import pytest
import yaml

from polyserve.cli import credentials
from polyserve.proto import Subjects
from polyserve.shared import auth, infra
from tests.unit.test_k8s_manifests import by_kind

pytestmark = pytest.mark.integration
SERVICES = ("gateway", "predictor", "dispatcher", "planner", "gpu-agent", "worker")


@pytest.fixture
def k8s_nats(tmp_path, monkeypatch):
    """(client url without credentials, {user: password}) of a nats-server running the k8s config."""
    secret_file = credentials.write_k8s_secrets(tmp_path / "secrets")
    stored = next(d for d in yaml.safe_load_all(secret_file.read_text()) if d["metadata"]["name"] == "polyserve-nats")
    [cfg] = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "nats-config"]
    conf = cfg["data"]["nats.conf"]
    conf = conf.replace("/var/run/nats/nats.pid", str(tmp_path / "nats.pid"))
    conf, n = re.subn(r"\n\s*store_dir: /data/jetstream", "", conf)  # start_nats gives it (-sd): no duplicate
    assert n == 1
    conf, n = re.subn(r"(cluster \{\s*name: \S+\s*port: )6222", rf"\g<1>{infra.free_port()}", conf)
    assert n == 1
    etc = tmp_path / "etc"
    (etc / "nats").mkdir(parents=True)
    (etc / "nats-auth").mkdir()
    (etc / "nats" / "nats.conf").write_text(conf)
    (etc / "nats-auth" / credentials.K8S_AUTH_FILE).write_text(stored["stringData"][credentials.K8S_AUTH_FILE])
    monkeypatch.setenv("POD_NAME", "nats-0")
    proc, url, _ = infra.start_nats(tmp_path / "run", config=etc / "nats" / "nats.conf")
    try:
        yield url, stored["stringData"]
    finally:
        proc.terminate()
        with contextlib.suppress(Exception):
            proc.wait(10)


async def _connect(url: str, user: str | None, password: str | None, errors: list[str] | None = None):
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    target = auth.with_userinfo(url, user, password) if user else url
    return await nats.connect(target, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                              error_cb=on_error, inbox_prefix=auth.inbox_prefix(user or "anon"))


async def _wait_for(errors: list[str], count: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while len(errors) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_each_k8s_service_is_its_own_user_and_anonymous_is_refused(k8s_nats):
    url, stored = k8s_nats
    for user in SERVICES:
        nc = await _connect(url, user, stored[user])  # the password its Deployment reads (key = its name)
        await nc.close()
    with pytest.raises(Exception, match="(?i)authorization"):
        await _connect(url, None, None)
    with pytest.raises(Exception, match="(?i)authorization"):  # one service's password is not another's
        await _connect(url, "planner", stored["worker"])


async def test_a_k8s_service_is_refused_the_subjects_it_must_not_use(k8s_nats):
    url, stored = k8s_nats
    subjects = Subjects("polyserve")
    start = subjects.agent("gpu-0", "start")
    agent = await _connect(url, "gpu-agent", stored["gpu-agent"])
    got: list = []

    async def on_start(msg):
        got.append(msg.data)

    await agent.subscribe(start, cb=on_start)
    await agent.flush()
    for user in ("worker", "dispatcher", "gateway", "predictor"):
        errors: list[str] = []
        nc = await _connect(url, user, stored[user], errors)
        await nc.publish(start, b"forged StartWorker")
        if user != "gateway":
            await nc.subscribe(f"{auth.inbox_prefix('gateway')}.>")
        await nc.flush()
        await _wait_for(errors, 1 if user == "gateway" else 2)
        await nc.close()
        text = " ".join(errors).lower()
        assert f'publish to "{start.lower()}"' in text, (user, errors)
        if user != "gateway":
            assert 'subscription to "_inbox.gateway.>"' in text, (user, errors)
    # the planner may: the agent receives its StartWorker, and nothing of the refused ones
    planner = await _connect(url, "planner", stored["planner"])
    await planner.publish(start, b"from the planner")
    await planner.flush()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert got == [b"from the planner"]
    # and the gateway may read its own inboxes
    errors: list[str] = []
    gw = await _connect(url, "gateway", stored["gateway"], errors)
    await gw.subscribe(f"{auth.inbox_prefix('gateway')}.>")
    await gw.flush()
    await asyncio.sleep(0.3)
    assert errors == []
    for nc in (planner, gw, agent):
        await nc.close()
