"""The infrastructure `polyserve up` starts, beyond one nats-server and one redis-server
(issue 13, docs/reliability.md):

* `--nats-cluster N` (N >= 3): N nats-servers on this host, routed into one cluster
  (routes authenticated), JetStream on each with its own store (RUN_DIR/nats/nats-K), the
  same users and permissions on every node; the services get all N URLs.
* `--redis-replica`: a replica (`replicaof` the primary, AOF everysec like it) and one Redis
  Sentinel (quorum 1) that promotes the replica when the primary has been down 1 s; the
  services connect through the Sentinel (`redis+sentinel://`, shared/state.py).

Both the launcher and the supervisor (restarts) use these functions.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from polyserve.shared import auth, infra

if TYPE_CHECKING:
    from polyserve.cli.launcher import ClusterSpec, ClusterState

SENTINEL = "redis-sentinel"
REPLICA = "redis-replica"


@dataclass
class Started:
    """What was started: process names -> pids, the operator's URL, state.json extras."""

    pids: dict[str, int] = field(default_factory=dict)
    url: str = ""
    monitor_port: int = 0
    extra: dict = field(default_factory=dict)


def _node_text(node: infra.NatsNode, nodes: list[infra.NatsNode], run_dir: Path, sec: auth.Secrets | None,
               spec: "ClusterSpec") -> str:
    auth_text = auth.nats_config(sec, spec.prefix, spec.nats_tls) if sec is not None else ""
    route_pw = sec.nats.get(auth.ROUTE_USER, "") if sec is not None else ""
    return infra.nats_node_config(node, nodes, run_dir / "nats" / node.name / "jetstream", auth_text,
                                  auth.ROUTE_USER, route_pw, cluster_name=spec.prefix)


def start_nats_cluster(spec: "ClusterSpec", sec: auth.Secrets | None, port: int) -> Started:
    """`spec.nats_cluster` nodes with client ports from `port`; waits until JetStream has a
    meta leader (so the services can create the replicated event stream)."""
    run_dir = spec.run_dir
    conf_dir = auth.secrets_dir(run_dir) if sec is not None else run_dir / "nats"
    conf_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):  # a port picked free may be taken before its node binds it: new ports
        nodes = infra.plan_nats_cluster(spec.nats_cluster, port if attempt == 0 else 0, conf_dir)
        out = Started(monitor_port=nodes[0].monitor_port, extra={"nats_nodes": [asdict(n) for n in nodes]})
        try:
            for node in nodes:
                auth.write_private(Path(node.config), _node_text(node, nodes, run_dir, sec, spec))
                out.pids[node.name] = infra.start_nats_node(run_dir / "nats", node).pid
            infra.wait_jetstream([n.monitor_port for n in nodes], timeout=30.0)
        except infra.InfraError:
            stop(out.pids)
            if attempt == 2:
                raise
            continue
        except BaseException:
            stop(out.pids)
            raise
        out.url = ",".join(n.url for n in nodes)
        return out
    raise AssertionError("unreachable")


def start_redis_replicated(spec: "ClusterSpec", files: dict[str, str], primary_port: int) -> Started:
    """The primary (as `redis-server`), its replica and a Sentinel; the URL names the Sentinel."""
    run_dir = spec.run_dir
    config = files.get("redis_config")
    out = Started()
    try:
        proc, _ = infra.start_redis(run_dir / "redis", port=primary_port, config=config)
        out.pids["redis-server"] = proc.pid
        replica_port = infra.free_port()
        proc, _ = infra.start_redis(run_dir / REPLICA, port=replica_port, config=config, replica_of=primary_port)
        out.pids[REPLICA] = proc.pid
        sentinel_port = infra.free_port()
        sconf = _sentinel_conf_path(spec, files)
        sec = auth.Secrets.load(Path(run_dir) / "secrets" / "credentials.json")
        if sec is None:  # without per-service users (--no-auth): a Sentinel anyone local may ask
            text = (f"port {sentinel_port}\nbind 127.0.0.1\ndir {run_dir / SENTINEL}\n"
                    f"sentinel monitor {spec.prefix} 127.0.0.1 {primary_port} 1\n"
                    f"sentinel down-after-milliseconds {spec.prefix} 1000\n"
                    f"sentinel failover-timeout {spec.prefix} 10000\n")
        else:
            text = auth.sentinel_config(sec, spec.prefix, primary_port, sentinel_port, run_dir / SENTINEL)
        (run_dir / SENTINEL).mkdir(parents=True, exist_ok=True)
        auth.write_private(sconf, text)
        out.pids[SENTINEL] = infra.start_sentinel(run_dir / SENTINEL, sconf, sentinel_port).pid
    except BaseException:
        stop(out.pids)
        raise
    out.url = f"redis+sentinel://127.0.0.1:{sentinel_port}/{spec.prefix}/0"
    out.extra = {"redis_nodes": {"primary_port": primary_port, "replica_port": replica_port,
                                 "sentinel_port": sentinel_port, "sentinel_config": str(sconf),
                                 "master": spec.prefix}}
    return out


def _sentinel_conf_path(spec: "ClusterSpec", files: dict[str, str]) -> Path:
    if files.get("redis_config"):
        return Path(files["redis_config"]).with_name("sentinel.conf")
    return spec.run_dir / SENTINEL / "sentinel.conf"


def stop(pids: dict[str, int]) -> None:
    for pid in pids.values():
        infra.stop_pid(pid, timeout=5.0)


def restart(name: str, state: "ClusterState") -> subprocess.Popen | None:
    """Start `name` again as `up` did (the supervisor); None when it is not one of ours."""
    run_dir = Path(state.run_dir)
    for raw in state.nats_nodes:
        if raw["name"] == name:
            return infra.start_nats_node(run_dir / "nats", infra.NatsNode(**raw))
    nodes = state.redis_nodes
    if not nodes or name not in ("redis-server", REPLICA, SENTINEL):
        return None
    if name == SENTINEL:
        return infra.start_sentinel(run_dir / SENTINEL, nodes["sentinel_config"], nodes["sentinel_port"])
    port = nodes["primary_port"] if name == "redis-server" else nodes["replica_port"]
    primary = current_primary_port(state)
    replica_of = primary if primary and primary != port else 0  # come back as the replica of the promoted one
    proc, _ = infra.start_redis(run_dir / ("redis" if name == "redis-server" else REPLICA), port=port,
                                config=state.redis_config or None, replica_of=replica_of)
    return proc


def current_primary_port(state: "ClusterState") -> int:
    """The port of the node the Sentinel calls primary now (0 when it cannot be asked)."""
    from redis.sentinel import Sentinel

    from polyserve.shared.state import parse_sentinel_url

    su = parse_sentinel_url(state.redis_url)
    if su is None:
        return 0
    try:
        s = Sentinel(su.sentinels, sentinel_kwargs={"username": su.username, "password": su.password,
                                                    "socket_timeout": 1.0})
        return int(s.discover_master(su.master)[1])
    except Exception:  # noqa: BLE001 - the Sentinel is down too: start as configured
        return 0


def describe(state: "ClusterState") -> str:
    """One line for `polyserve up`'s summary."""
    parts = []
    if state.nats_nodes:
        parts.append(f"NATS cluster of {len(state.nats_nodes)} ({', '.join(n['name'] for n in state.nats_nodes)})")
    if state.redis_nodes:
        parts.append(f"Redis primary + replica, Sentinel on {state.redis_nodes['sentinel_port']}")
    return "; ".join(parts) or json.dumps({})
