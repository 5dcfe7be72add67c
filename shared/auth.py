"""Credentials of a polyserve cluster: who may connect to NATS and Redis, and what each
service may publish, subscribe and touch (docs/security.md).

`polyserve up` generates fresh passwords on every start (`Secrets.generate`), writes them
owner-only (0600) into RUN_DIR/secrets/ with the nats-server and redis-server
configurations made from them, and hands each service only its own credentials, as the
userinfo of its POLYSERVE_NATS_URL / POLYSERVE_REDIS_URL. Pure functions plus the
owner-only file writes; no network.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

SERVICES = ("gateway", "predictor", "dispatcher", "planner", "gpu-agent", "worker")
OPERATOR = "cli"  # `polyserve status/events`, the launcher, the supervisor: the run dir's owner
USERS = (*SERVICES, OPERATOR)
INBOX = "_INBOX"
ROUTE_USER = "_route"  # NATS cluster routes between nodes
REPLICA_USER = "_replica"  # a Redis replica syncing from its primary
SENTINEL_USER = "_sentinel"  # Redis Sentinel watching and reconfiguring the data nodes


def inbox_prefix(service: str) -> str:
    """The reply-inbox prefix of a service's NATS connection (`shared/bus.py`): only that
    service's user may subscribe below it."""
    return f"{INBOX}.{service}"


def nats_permissions(prefix: str) -> dict[str, dict]:
    """Per user: the subjects it may publish and subscribe (nats-server `permissions`).

    Services that answer requests get `allow_responses` (one reply to a request they
    received, whatever its inbox); a worker also streams TokenChunks to the gateway's
    inboxes. Every service may read events and telemetry and announce its own state."""
    p = f"{prefix}.v1"
    events = [f"{p}.events.>", f"{p}.telemetry.>"]
    service_state = f"{p}.events.service.>"
    # replay: a stream's chunks again (a seq gap); credit: flow control of slow readers (issue 13)
    worker = [f"{p}.worker.*.{verb}" for verb in ("generate", "cancel", "withdraw", "embed", "replay", "credit")]
    perms = {
        "gateway": {"pub": [f"{p}.predict", f"{p}.predict_batch", f"{p}.dispatch", *[s for s in worker if not s.endswith("withdraw")],
                            f"{p}.adapters.*", f"{p}.events.request.>", service_state, f"{p}.gateway.prefixes"],
                    "sub": [*events, f"{p}.gateway.prefixes"]},
        "predictor": {"pub": [service_state], "sub": [f"{p}.predict", f"{p}.predict_batch", *events]},
        "dispatcher": {"pub": [f"{p}.worker.*.withdraw", f"{p}.events.plan.signal.*", service_state],
                       "sub": [f"{p}.dispatch", *events]},
        "planner": {"pub": [f"{p}.agent.*.start", f"{p}.agent.*.stop", f"{p}.events.plan.scale.*",
                            f"{p}.events.plan.runtimes.*", service_state],
                    "sub": [*events]},
        "gpu-agent": {"pub": [f"{p}.events.worker.down", f"{p}.telemetry.gpu.*", f"{p}.telemetry.energy.*",
                              f"{p}.telemetry.clock.*", f"{p}.events.plan.signal.*", service_state],
                      "sub": [f"{p}.agent.*.start", f"{p}.agent.*.stop", *events]},
        "worker": {"pub": [f"{p}.events.worker.>", service_state, f"{inbox_prefix('gateway')}.>"],
                   "sub": [*worker, f"{p}.adapters.*"]},
    }
    stream = f"{prefix}_request_events"  # shared/durable.py: completed/failed kept by JetStream
    manage = [f"$JS.API.STREAM.{op}.{stream}" for op in ("INFO", "CREATE", "UPDATE")]
    consume = [f"$JS.API.CONSUMER.CREATE.{stream}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
               f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.API.CONSUMER.DELETE.{stream}.*", f"$JS.ACK.{stream}.>"]
    for user in ("gateway", "predictor", "dispatcher", "planner", "gpu-agent"):
        perms[user]["pub"] += manage + ([] if user == "gateway" else consume)
    out = {}
    for user, pp in perms.items():
        out[user] = {"publish": {"allow": pp["pub"]},
                     "subscribe": {"allow": [*pp["sub"], f"{inbox_prefix(user)}.>"]}}
        if user != "gateway":  # the gateway answers no requests
            out[user]["allow_responses"] = True
    # the operator publishes nothing but JetStream's two read-only lookups on the event stream
    # (`polyserve events --since`: stream state, one stored message; cli/events.py)
    out[OPERATOR] = {"publish": {"allow": [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}"]},
                     "subscribe": {"allow": [f"{prefix}.>", f"{inbox_prefix(OPERATOR)}.>"]}}
    return out


@dataclass
class Secrets:
    """user -> password for NATS and for Redis."""

    nats: dict[str, str]
    redis: dict[str, str]

    @classmethod
    def generate(cls) -> "Secrets":
        """A password per user, plus the internal ones: NATS cluster routes (ROUTE_USER), Redis
        replication (REPLICA_USER) and Sentinel's own connections to the data nodes (SENTINEL_USER)."""
        return cls(nats={u: token(24) for u in (*USERS, ROUTE_USER)},
                   redis={u: token(24) for u in (*USERS, REPLICA_USER, SENTINEL_USER)})

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "Secrets | None":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except FileNotFoundError:
            return None


@dataclass(frozen=True)
class TlsFiles:
    """nats-server TLS: its certificate and key; `ca` verifies it on the client side."""

    cert: str
    key: str
    ca: str = ""


def secrets_dir(run_dir: Path) -> Path:
    """RUN_DIR/secrets, made owner-only (0700)."""
    d = Path(run_dir) / "secrets"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 from the first byte (no window where others can read)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def nats_config(sec: Secrets, prefix: str, tls: TlsFiles | None = None) -> str:
    """nats-server configuration: one user per service with its permissions; no anonymous access."""
    perms = nats_permissions(prefix)
    users = [{"user": u, "password": sec.nats[u], "permissions": perms[u]} for u in USERS]
    text = "# generated by `polyserve up`; owner-only (secrets/). Regenerated on every start.\n"
    text += f"authorization: {json.dumps({'users': users, 'timeout': 2}, indent=2)}\n"
    if tls is not None:
        text += f"tls: {json.dumps({'cert_file': tls.cert, 'key_file': tls.key, 'timeout': 2})}\n"
    return text


def _digest(pw: str) -> str:
    return "#" + hashlib.sha256(pw.encode()).hexdigest()


def redis_config(sec: Secrets, prefix: str, replication: bool = False) -> str:
    """redis-server configuration: the default user off; a user per service limited to the
    cluster's keys, without admin or dangerous commands (CONFIG, DEBUG, MODULE, KEYS, ...);
    the operator user may do everything. Passwords are stored as SHA-256 hashes.

    `replication`: the same file serves the primary and its replica (either may be promoted):
    a replication user and Sentinel's user (the commands Sentinel's documentation lists), and
    the credentials a replica syncs with."""
    lines = ["# generated by `polyserve up`; owner-only (secrets/). Regenerated on every start.",
             "user default off resetpass resetkeys resetchannels -@all"]  # no nopass: not left open
    for u in SERVICES:
        lines.append(f"user {u} on {_digest(sec.redis[u])} ~{prefix}:* resetchannels +@all -@admin -@dangerous")
    lines.append(f"user {OPERATOR} on {_digest(sec.redis[OPERATOR])} ~* &* +@all")
    if replication:
        lines += [f"user {REPLICA_USER} on {_digest(sec.redis[REPLICA_USER])} +psync +replconf +ping",
                  f"user {SENTINEL_USER} on {_digest(sec.redis[SENTINEL_USER])} resetchannels &__sentinel__:hello +multi "
                  "+slaveof +ping +exec +subscribe +config|rewrite +role +publish +info +client|setname "
                  "+client|kill +script|kill",
                  f"masteruser {REPLICA_USER}", f"masterauth {sec.redis[REPLICA_USER]}"]
    return "\n".join(lines) + "\n"


SENTINEL_READ = ("+ping +auth +hello +client|setname +client|getname +sentinel|masters +sentinel|master "
                 "+sentinel|get-master-addr-by-name +sentinel|slaves +sentinel|replicas +sentinel|sentinels")


def sentinel_config(sec: Secrets, master: str, primary_port: int, port: int, data_dir: Path,
                    down_after_ms: int = 1000) -> str:
    """redis-server --sentinel configuration (one Sentinel: quorum 1; docs/reliability.md):
    it watches the primary on `primary_port` with its own user, promotes the replica when
    the primary has been down `down_after_ms`. Each service may only ask where the primary
    is, with its usual Redis password; the operator may do everything."""
    lines = ["# generated by `polyserve up`; owner-only (secrets/); Sentinel rewrites it as it runs.",
             f"port {port}", "bind 127.0.0.1", "daemonize no", f"dir {data_dir}",
             "sentinel resolve-hostnames no",
             f"sentinel monitor {master} 127.0.0.1 {primary_port} 1",
             f"sentinel down-after-milliseconds {master} {down_after_ms}",
             f"sentinel failover-timeout {master} 10000",
             f"sentinel parallel-syncs {master} 1",
             f"sentinel auth-user {master} {SENTINEL_USER}",
             f"sentinel auth-pass {master} {sec.redis[SENTINEL_USER]}",
             "user default off resetpass resetkeys resetchannels -@all"]  # no nopass: not left open
    for u in SERVICES:
        lines.append(f"user {u} on {_digest(sec.redis[u])} resetchannels -@all {SENTINEL_READ}")
    lines.append(f"user {OPERATOR} on {_digest(sec.redis[OPERATOR])} ~* &* +@all")
    return "\n".join(lines) + "\n"


def _each(url: str, fn) -> str:
    """Apply `fn` to each URL of a comma-separated list (a NATS cluster: POLYSERVE_NATS_URL)."""
    pieces = url.split(",")
    if len(pieces) > 1 and all("://" in p for p in pieces):
        return ",".join(fn(p.strip()) for p in pieces)
    return fn(url)


def with_userinfo(url: str, user: str, password: str) -> str:
    """`url` with `user:password@` (replacing any userinfo it had); each URL of a list."""
    return _each(url, lambda u: _with_userinfo(u, user, password))


def _with_userinfo(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """`url` without its password (for printing and logs); each URL of a list."""
    return _each(url, _redact)


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def strip_userinfo(url: str) -> str:
    return _each(url, _strip_userinfo)


def _strip_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, parts.query, parts.fragment))


def service_env(sec: Secrets, service: str, nats_url: str, redis_url: str) -> dict[str, str]:
    """The connection settings of one service's process; the gpu-agent also gets the
    workers' (it passes them to the workers it starts, and nothing else of its own)."""
    env = {"POLYSERVE_NATS_URL": with_userinfo(nats_url, service, sec.nats[service]),
           "POLYSERVE_REDIS_URL": with_userinfo(redis_url, service, sec.redis[service])}
    if service == "gpu-agent":
        env["POLYSERVE_GPU_AGENT_WORKER_NATS_URL"] = with_userinfo(nats_url, "worker", sec.nats["worker"])
        env["POLYSERVE_GPU_AGENT_WORKER_REDIS_URL"] = with_userinfo(redis_url, "worker", sec.redis["worker"])
    return env


@functools.lru_cache(maxsize=64)
def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost). Cached:
    the gateway asks it of its own host on every request (access.keys_required; issue 15)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token(nbytes: int) -> str:
    """A URL-safe random secret of `nbytes` bytes that does not start with '-': a command line
    reads `--api-key -WM...` as a missing value and an option (one key in 64 did; the compose
    test failed on one)."""
    while True:
        value = secrets.token_urlsafe(nbytes)
        if not value.startswith("-"):
            return value


def load_or_create_admin_key(path: Path, given: str | None = None) -> str:
    """The admin API key in `path` (0600): `given` when not None, else the one already
    there, else a new one. Kept across restarts so scripts that read it keep working."""
    path = Path(path)
    if given is None and path.exists():
        key = path.read_text().strip()
        if key:
            os.chmod(path, 0o600)
            return key
    key = given if given is not None else token(32)
    write_private(path, key + "\n")
    return key
