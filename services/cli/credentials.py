"""The secrets `polyserve up` makes and hands out (docs/security.md): per-service NATS and
Redis credentials with the server configurations made from them, and the admin API key,
all owner-only in RUN_DIR/secrets. Each service process gets only its own credentials."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from polyserve.shared import auth

if TYPE_CHECKING:
    from polyserve.cli.launcher import ClusterSpec

ADMIN_KEY_ENV = "POLYSERVE_GATEWAY_ADMIN_API_KEY"


def service_env(name: str, env: dict[str, str], run_dir: Path) -> dict[str, str]:
    """`env` plus the credentials of service `name` (gateway, gpu-agent, ...) only (RUN_DIR/secrets,
    written by `secure`); the gateway also gets the admin API key."""
    env = dict(env)
    sdir = Path(run_dir) / "secrets"
    sec = auth.Secrets.load(sdir / "credentials.json")
    if sec is not None:
        env.update(auth.service_env(sec, name, env["POLYSERVE_NATS_URL"], env["POLYSERVE_REDIS_URL"]))
    env.pop(ADMIN_KEY_ENV, None)
    if name == "gateway":
        key_file = sdir / "admin.key"
        env[ADMIN_KEY_ENV] = key_file.read_text().strip() if key_file.exists() else ""
    return env


def secure(spec: "ClusterSpec", progress=print) -> tuple[auth.Secrets | None, dict[str, str]]:
    """Generate this start's NATS and Redis credentials and server configurations, and the
    admin API key, owner-only in RUN_DIR/secrets (docs/security.md); the ClusterState fields
    naming the files."""
    sdir = auth.secrets_dir(spec.run_dir)
    files: dict[str, str] = {}
    key_file = sdir / "admin.key"
    given = spec.admin_key
    if given is None:
        given = spec.extra_env.get(ADMIN_KEY_ENV) or os.environ.get(ADMIN_KEY_ENV) or None
    if given == "":
        key_file.unlink(missing_ok=True)
        progress("warning: the admin API is open (--no-admin-key)")
    else:
        auth.load_or_create_admin_key(key_file, given)
        files["admin_key_file"] = str(key_file)
    if not auth.is_loopback(spec.host):
        progress(f"warning: the gateway listens on {spec.host}: its inference endpoints need no key "
                 "(client API keys are not implemented yet); put it behind a trusted network or proxy")
    for name in ("credentials.json", "nats.conf", "redis.conf"):
        (sdir / name).unlink(missing_ok=True)
    if not spec.auth:
        return None, files
    sec = auth.Secrets.generate()
    sec.save(sdir / "credentials.json")
    auth.write_private(sdir / "nats.conf", auth.nats_config(sec, spec.prefix, spec.nats_tls))
    auth.write_private(sdir / "redis.conf", auth.redis_config(sec, spec.prefix))
    files.update(nats_config=str(sdir / "nats.conf"), redis_config=str(sdir / "redis.conf"))
    if spec.nats_tls is not None and spec.nats_tls.ca:
        files["nats_tls_ca"] = spec.nats_tls.ca
    return sec, files
