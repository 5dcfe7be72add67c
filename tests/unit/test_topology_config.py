"""Pure parts of the NATS cluster / Redis replica topology (issue 13): URL lists, Sentinel
URLs, node and Sentinel configurations, the durable event subjects."""
from __future__ import annotations

from pathlib import Path

import pytest

from polyserve.shared import auth, durable, infra
from polyserve.shared.bus import connect_options, split_urls
from polyserve.shared.state import parse_sentinel_url


def test_nats_url_lists_carry_one_user_to_every_server():
    url = "nats://127.0.0.1:1,nats://127.0.0.1:2, 127.0.0.1:3"
    assert split_urls(url) == ["nats://127.0.0.1:1", "nats://127.0.0.1:2", "nats://127.0.0.1:3"]
    creds = auth.with_userinfo("nats://127.0.0.1:1,nats://127.0.0.1:2", "worker", "pw")
    assert creds == "nats://worker:pw@127.0.0.1:1,nats://worker:pw@127.0.0.1:2"
    assert auth.redact(creds) == "nats://worker:***@127.0.0.1:1,nats://worker:***@127.0.0.1:2"
    assert auth.strip_userinfo(creds) == "nats://127.0.0.1:1,nats://127.0.0.1:2"
    opts = connect_options(creds)
    # the servers go without userinfo, so the ones the cluster announces authenticate alike
    assert opts == {"servers": ["nats://127.0.0.1:1", "nats://127.0.0.1:2"], "user": "worker", "password": "pw"}
    assert connect_options("nats://127.0.0.1:4222") == {"servers": ["nats://127.0.0.1:4222"]}


def test_sentinel_urls():
    su = parse_sentinel_url("redis+sentinel://gateway:pw@127.0.0.1:26379,10.0.0.2:26380/polyserve/2")
    assert su.sentinels == [("127.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert (su.master, su.db, su.username, su.password) == ("polyserve", 2, "gateway", "pw")
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None
    assert parse_sentinel_url("unix:///tmp/r.sock") is None
    with pytest.raises(ValueError, match="master name"):
        parse_sentinel_url("redis+sentinel://127.0.0.1:26379")
    url = auth.with_userinfo("redis+sentinel://127.0.0.1:26379/polyserve/0", "worker", "pw")
    assert parse_sentinel_url(url).username == "worker"


def test_cluster_node_configuration_routes_to_peers_with_credentials(tmp_path: Path):
    nodes = [infra.NatsNode(f"nats-{i}", 4222 + i, 8222 + i, 6222 + i, str(tmp_path / f"nats-{i}.conf"))
             for i in (1, 2, 3)]
    sec = auth.Secrets.generate()
    text = infra.nats_node_config(nodes[0], nodes, tmp_path / "js", auth.nats_config(sec, "p"),
                                  auth.ROUTE_USER, sec.nats[auth.ROUTE_USER])
    route_pw = sec.nats[auth.ROUTE_USER]
    for peer in nodes[1:]:
        assert f"nats-route://{auth.ROUTE_USER}:{route_pw}@127.0.0.1:{peer.cluster_port}" in text
    assert f"127.0.0.1:{nodes[0].cluster_port}" in text and '"authorization"' in text
    assert all(sec.nats[u] in text for u in auth.USERS)  # the same users on every node
    assert f"nats-route://{auth.ROUTE_USER}:{route_pw}@127.0.0.1:{nodes[0].cluster_port}" not in text


def test_replication_users_and_sentinel_configuration(tmp_path: Path):
    sec = auth.Secrets.generate()
    rconf = auth.redis_config(sec, "p", replication=True)
    assert f"masteruser {auth.REPLICA_USER}" in rconf and "+psync" in rconf
    assert sec.redis[auth.REPLICA_USER] in rconf  # masterauth: a replica must present it
    assert sec.redis[auth.SENTINEL_USER] not in rconf  # hashed
    assert "masteruser" not in auth.redis_config(sec, "p")
    sconf = auth.sentinel_config(sec, "p", 6379, 26379, tmp_path)
    assert "sentinel monitor p 127.0.0.1 6379 1" in sconf
    assert f"sentinel auth-pass p {sec.redis[auth.SENTINEL_USER]}" in sconf
    assert "user default off" in sconf and all(sec.redis[u] not in sconf for u in auth.SERVICES)


def test_only_terminal_request_events_are_durable():
    assert durable.prefix_of("p.v1.events.request.completed") == "p"
    assert durable.prefix_of("a-b.v1.events.request.failed") == "a-b"
    assert durable.prefix_of("p.v1.events.request.admitted") is None
    assert durable.prefix_of("p.v1.events.worker.down") is None
    assert durable.stream_subjects("p") == ["p.v1.events.request.completed", "p.v1.events.request.failed"]
    assert durable.replicas_for(1) == 1 and durable.replicas_for(3) == 3
    perms = auth.nats_permissions("p")
    assert "$JS.API.STREAM.CREATE.p_request_events" in perms["gateway"]["publish"]["allow"]
    assert "$JS.ACK.p_request_events.>" in perms["dispatcher"]["publish"]["allow"]
    assert not any(s.startswith("$JS") for s in perms["worker"]["publish"]["allow"])


def test_compose_credentials_give_each_service_only_its_own(tmp_path: Path):
    from polyserve.cli import credentials

    out = tmp_path / "secrets"
    sec = credentials.write_compose_secrets(out, nats_url="nats://nats:4222", redis_url="redis://redis:6379/0")
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    env = dict(line.split("=", 1) for line in (out / "dispatcher.env").read_text().splitlines())
    assert env["POLYSERVE_NATS_URL"] == f"nats://dispatcher:{sec.nats['dispatcher']}@nats:4222"
    assert env["POLYSERVE_REDIS_URL"] == f"redis://dispatcher:{sec.redis['dispatcher']}@redis:6379/0"
    assert "ADMIN" not in (out / "dispatcher.env").read_text()
    gw = (out / "gateway.env").read_text()
    assert f"POLYSERVE_GATEWAY_ADMIN_API_KEY={(out / 'admin.key').read_text().strip()}" in gw
    assert f"worker:{sec.nats['worker']}@" in (out / "gpu-agent.env").read_text()
    for name in ("gateway.env", "admin.key", "credentials.json", "operator.env"):
        assert oct((out / name).stat().st_mode & 0o777) == "0o600", name
    assert "user default off" in (out / "redis.conf").read_text()
    again = credentials.write_compose_secrets(out)  # idempotent: the same passwords
    assert again.nats == sec.nats
    assert credentials.write_compose_secrets(out, rotate=True).nats != sec.nats


def test_nats_server_runs_on_one_go_processor_on_small_machines(monkeypatch):
    from polyserve.shared import infra

    monkeypatch.delenv("GOMAXPROCS", raising=False)
    assert infra.nats_env(cpus=2)["GOMAXPROCS"] == "1"
    assert "GOMAXPROCS" not in infra.nats_env(cpus=16)
    monkeypatch.setenv("GOMAXPROCS", "3")  # the operator's own setting wins
    assert infra.nats_env(cpus=2)["GOMAXPROCS"] == "3"
