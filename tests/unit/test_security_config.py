"""The pure parts of issue 14's hardening: the gpu-agent's worker environment allowlist, the
generated NATS permissions and server configurations, URL credentials, owner-only files."""
from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from polyserve.cli import credentials
from polyserve.gpu_agent import policy
from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.handlers import AgentHandlers
from polyserve.proto import StartWorker
from polyserve.shared import auth
from polyserve.shared.bus import BusError
from polyserve.shared.settings import SettingsError, load

INJECTION = {"PYTHONWARNINGS": "all:0:antigravity.x:0:0", "BROWSER": "/bin/sh -c 'touch /tmp/x' #%s"}


def test_extra_env_allows_worker_settings_only():
    assert policy.check_extra_env({"POLYSERVE_WORKER_ENCODER_BATCH": "4", "POLYSERVE_WORKER_TIME_SCALE": "0"}) == []
    refused = dict(policy.check_extra_env({**INJECTION, "LD_PRELOAD": "/x.so", "PATH": "/tmp",
                                           "POLYSERVE_WORKER_": "x", "POLYSERVE_WORKER_bad-name": "1"}))
    assert set(refused) == {"PYTHONWARNINGS", "BROWSER", "LD_PRELOAD", "PATH", "POLYSERVE_WORKER_",
                            "POLYSERVE_WORKER_bad-name"}
    owned = dict(policy.check_extra_env({"POLYSERVE_WORKER_NATS_URL": "nats://evil:4222",
                                         "POLYSERVE_WORKER_WORKER_ID": "w-x"}))
    assert set(owned) == {"POLYSERVE_WORKER_NATS_URL", "POLYSERVE_WORKER_WORKER_ID"}
    assert policy.check_extra_env({"POLYSERVE_WORKER_PROFILE": "a\0b"})
    assert policy.check_extra_env({f"POLYSERVE_WORKER_X{i}": "1" for i in range(100)})
    assert policy.check_extra_env({"FAKE_WORKER_EXIT": "3"}, frozenset({"FAKE_WORKER_EXIT"})) == []


def test_worker_env_drops_the_agents_own_settings_and_connections():
    base = {"PATH": "/usr/bin", "POLYSERVE_GPU_AGENT_WORKER_NATS_URL": "nats://worker:pw@h:1",
            "POLYSERVE_NATS_URL": "nats://gpu-agent:secret@h:1", "POLYSERVE_WORKER_NATS_URL": "nats://other@h:1",
            "POLYSERVE_WORKER_TIME_SCALE": "0.1"}
    env = policy.worker_env(base, nats_url="nats://worker:pw@h:1", redis_url="redis://worker:pw@h:2/0",
                            prefix="p", worker_id="w-1", deployment="d", model="m", engine="sim", gpu_id="g")
    assert env["POLYSERVE_NATS_URL"] == "nats://worker:pw@h:1" and "secret" not in json.dumps(env)
    assert not any(k.startswith("POLYSERVE_GPU_AGENT_") for k in env)
    assert "POLYSERVE_WORKER_NATS_URL" not in env and env["POLYSERVE_WORKER_TIME_SCALE"] == "0.1"


def test_worker_env_allow_setting():
    s = load(GpuAgentSettings, "gpu-agent", environ={"POLYSERVE_GPU_AGENT_WORKER_ENV_ALLOW": "A_B, C"})
    assert s.extra_env_allowed() == {"A_B", "C"}
    with pytest.raises(SettingsError):
        load(GpuAgentSettings, "gpu-agent", environ={"POLYSERVE_GPU_AGENT_WORKER_ENV_ALLOW": "A=B"})


def test_start_handler_refuses_with_the_key_names_and_an_event():
    events, spawned = [], []

    async def publish(ev):
        events.append(ev)

    async def info():
        pass

    settings = load(GpuAgentSettings, "gpu-agent", environ={})
    h = AgentHandlers(settings, pool=None, energy=None, spawn=spawned.append, publish_info=info,  # type: ignore[arg-type]
                      gpu_id=lambda: "sim0", publish_refusal=publish)
    with pytest.raises(BusError) as err:
        asyncio.run(h.start(StartWorker(deployment="d", model="m", engine="sim", extra_env=INJECTION)))
    assert err.value.code == 400 and "PYTHONWARNINGS" in err.value.description
    assert "antigravity" not in err.value.description
    assert not spawned and events[0].keys == ["PYTHONWARNINGS", "BROWSER"] and events[0].action == "start_worker"


def test_nats_permissions_confine_each_service():
    perms = auth.nats_permissions("p")
    assert set(perms) == set(auth.USERS)
    starters = [u for u, pp in perms.items() if "p.v1.agent.*.start" in pp["publish"].get("allow", [])]
    assert starters == ["planner"]
    readers = [u for u, pp in perms.items() if "_INBOX.gateway.>" in pp["subscribe"]["allow"]]
    assert readers == ["gateway"]
    assert "_INBOX.gateway.>" in perms["worker"]["publish"]["allow"]  # token chunks
    generate_readers = [u for u, pp in perms.items() if "p.v1.worker.*.generate" in pp["subscribe"]["allow"]]
    assert generate_readers == ["worker"]
    # the operator publishes only JetStream's read-only lookups on the event stream (events --since)
    assert perms[auth.OPERATOR]["publish"] == {"allow": ["$JS.API.STREAM.INFO.p_request_events",
                                                         "$JS.API.STREAM.MSG.GET.p_request_events"]}
    for user, pp in perms.items():
        assert all(s.startswith(("p.", "_INBOX.")) for s in pp["subscribe"]["allow"]), user


def test_server_configurations_hold_every_user_and_no_anonymous_access():
    sec = auth.Secrets.generate()
    conf = auth.nats_config(sec, "p", auth.TlsFiles(cert="/c.pem", key="/k.pem"))
    assert all(sec.nats[u] in conf for u in auth.USERS) and "no_auth_user" not in conf and "/c.pem" in conf
    rconf = auth.redis_config(sec, "p")
    assert "user default off" in rconf and all(pw not in rconf for pw in sec.redis.values())
    assert "user worker on #" in rconf and "~p:*" in rconf and "-@dangerous" in rconf


def test_urls_carry_and_hide_credentials():
    url = auth.with_userinfo("nats://old:x@127.0.0.1:4222", "worker", "pw")
    assert url == "nats://worker:pw@127.0.0.1:4222"
    assert auth.redact(url) == "nats://worker:***@127.0.0.1:4222"
    assert auth.strip_userinfo(url) == "nats://127.0.0.1:4222"
    assert auth.with_userinfo("redis://127.0.0.1:6379/0", "cli", "pw") == "redis://cli:pw@127.0.0.1:6379/0"
    assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1") and auth.is_loopback("localhost")
    assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("10.0.0.1") and not auth.is_loopback("")


def test_each_service_gets_only_its_own_credentials(tmp_path):
    sdir = auth.secrets_dir(tmp_path)
    sec = auth.Secrets.generate()
    sec.save(sdir / "credentials.json")
    auth.load_or_create_admin_key(sdir / "admin.key")
    assert stat.S_IMODE(os.stat(sdir / "credentials.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sdir / "admin.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sdir).st_mode) == 0o700
    base = {"POLYSERVE_NATS_URL": "nats://127.0.0.1:1", "POLYSERVE_REDIS_URL": "redis://127.0.0.1:2/0",
            credentials.ADMIN_KEY_ENV: "leaked"}
    for name in auth.SERVICES:
        env = credentials.service_env(name, base, tmp_path)
        others = [pw for u, pw in [*sec.nats.items(), *sec.redis.items()]
                  if u != name and not (name == "gpu-agent" and u == "worker")]
        assert not any(pw in json.dumps(env) for pw in others), name
        assert env["POLYSERVE_NATS_URL"] == f"nats://{name}:{sec.nats[name]}@127.0.0.1:1"
        assert (credentials.ADMIN_KEY_ENV in env) == (name == "gateway") and "leaked" not in json.dumps(env)
    key = (sdir / "admin.key").read_text().strip()
    assert auth.load_or_create_admin_key(sdir / "admin.key") == key  # kept across restarts


def test_generated_secrets_never_start_with_a_dash(monkeypatch):
    """A secret starting with '-' reads as an option on a command line (`--api-key -WM...`)."""
    import secrets as _secrets

    from polyserve.shared import auth

    draws = iter(["-WMabc", "--x", "ok-key"])
    monkeypatch.setattr(_secrets, "token_urlsafe", lambda n: next(draws))
    assert auth.token(32) == "ok-key"
