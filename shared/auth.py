"""Credentials of a polyserve cluster: who may connect to NATS and Redis, and what each
service may publish, subscribe and touch (docs/security.md).

`polyserve up` generates fresh passwords on every start (`Secrets.generate`), writes them
owner-only (0600) into RUN_DIR/secrets/ with the nats-server and redis-server
configurations made from them, and hands each service only its own credentials, as the
userinfo of its POLYSERVE_NATS_URL / POLYSERVE_REDIS_URL. Pure functions plus the
owner-only file writes; no network.
"""
from __future__ import annotations

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
    worker = [f"{p}.worker.*.{verb}" for verb in ("generate", "cancel", "withdraw", "embed")]
    perms = {
        "gateway": {"pub": [f"{p}.predict", f"{p}.dispatch", *[s for s in worker if not s.endswith("withdraw")],
                            f"{p}.adapters.*", f"{p}.events.request.>", service_state],
                    "sub": [*events]},
        "predictor": {"pub": [service_state], "sub": [f"{p}.predict", *events]},
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
    out = {}
    for user, pp in perms.items():
        out[user] = {"publish": {"allow": pp["pub"]},
                     "subscribe": {"allow": [*pp["sub"], f"{inbox_prefix(user)}.>"]}}
        if user != "gateway":  # the gateway answers no requests
            out[user]["allow_responses"] = True
    out[OPERATOR] = {"publish": {"deny": [">"]},
                     "subscribe": {"allow": [f"{prefix}.>", f"{inbox_prefix(OPERATOR)}.>"]}}
    return out


@dataclass
class Secrets:
    """user -> password for NATS and for Redis."""

    nats: dict[str, str]
    redis: dict[str, str]

    @classmethod
    def generate(cls) -> "Secrets":
        return cls(nats={u: secrets.token_urlsafe(24) for u in USERS},
                   redis={u: secrets.token_urlsafe(24) for u in USERS})

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


def redis_config(sec: Secrets, prefix: str) -> str:
    """redis-server configuration: the default user off; a user per service limited to the
    cluster's keys, without admin or dangerous commands (CONFIG, DEBUG, MODULE, KEYS, ...);
    the operator user may do everything. Passwords are stored as SHA-256 hashes."""
    def digest(pw: str) -> str:
        return "#" + hashlib.sha256(pw.encode()).hexdigest()

    lines = ["# generated by `polyserve up`; owner-only (secrets/). Regenerated on every start.",
             "user default off resetkeys resetchannels -@all"]
    for u in SERVICES:
        lines.append(f"user {u} on {digest(sec.redis[u])} ~{prefix}:* resetchannels +@all -@admin -@dangerous")
    lines.append(f"user {OPERATOR} on {digest(sec.redis[OPERATOR])} ~* &* +@all")
    return "\n".join(lines) + "\n"


def with_userinfo(url: str, user: str, password: str) -> str:
    """`url` with `user:password@` (replacing any userinfo it had)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """`url` without its password (for printing and logs)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def strip_userinfo(url: str) -> str:
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


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_or_create_admin_key(path: Path, given: str | None = None) -> str:
    """The admin API key in `path` (0600): `given` when not None, else the one already
    there, else a new one. Kept across restarts so scripts that read it keep working."""
    path = Path(path)
    if given is None and path.exists():
        key = path.read_text().strip()
        if key:
            os.chmod(path, 0o600)
            return key
    key = given if given is not None else secrets.token_urlsafe(32)
    write_private(path, key + "\n")
    return key
