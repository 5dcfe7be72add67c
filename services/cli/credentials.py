"""The secrets `polyserve up` makes and hands out (docs/security.md): per-service NATS and
Redis credentials with the server configurations made from them, and the admin API key,
all owner-only in RUN_DIR/secrets. Each service process gets only its own credentials.
`polyserve credentials compose|k8s` writes the same per-service NATS users for docker compose
and for the Kubernetes manifests of infra/k8s."""
from __future__ import annotations

import os
import secrets
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
        progress(f"note: the gateway listens on {spec.host}: its inference endpoints need a client API key "
                 "(`polyserve keys create --tenant NAME`; docs/security.md)")
    for name in ("credentials.json", "nats.conf", "redis.conf"):
        (sdir / name).unlink(missing_ok=True)
    if not spec.auth:
        return None, files
    sec = auth.Secrets.generate()
    sec.save(sdir / "credentials.json")
    auth.write_private(sdir / "nats.conf", auth.nats_config(sec, spec.prefix, spec.nats_tls))
    auth.write_private(sdir / "redis.conf", auth.redis_config(sec, spec.prefix, replication=spec.redis_replica))
    files.update(nats_config=str(sdir / "nats.conf"), redis_config=str(sdir / "redis.conf"))
    if spec.nats_tls is not None and spec.nats_tls.ca:
        files["nats_tls_ca"] = spec.nats_tls.ca
    return sec, files


# ---------------------------------------------------------------- docker compose (issue 14)
COMPOSE_SERVICES = ("gateway", "predictor", "dispatcher", "planner", "gpu-agent")


def write_compose_secrets(out: Path, prefix: str = "polyserve", nats_url: str = "nats://nats:4222",
                          redis_url: str = "redis://redis:6379/0", rotate: bool = False) -> auth.Secrets:
    """The credentials of a compose stack (compose.yaml reads them from `out`, default ./secrets):

    * `nats.conf`, `redis.conf`: the users and permissions nats-server and redis-server load
      (compose `secrets:`), the same per-service users as `polyserve up` makes;
    * `<service>.env`: each service's own POLYSERVE_NATS_URL / POLYSERVE_REDIS_URL (compose
      `env_file:`), the gateway's with the admin key, the gpu-agent's with the workers';
    * `operator.env` (the `cli` user: `polyserve events --server`, the compose test) and `admin.key`.

    `out` is made owner-only (0700); the files the containers read as another user (the two
    server configurations, mounted as secrets) are 0644 inside it, the rest 0600. Kept when
    they exist (an idempotent re-run), new ones with `rotate`."""
    out, sec = _secrets_dir(out, rotate)
    sec.save(out / "credentials.json")
    admin = auth.load_or_create_admin_key(out / "admin.key", auth.token(32) if rotate else None)
    for name, text in (("nats.conf", auth.nats_config(sec, prefix)), ("redis.conf", auth.redis_config(sec, prefix))):
        auth.write_private(out / name, text)
        os.chmod(out / name, 0o644)  # read by nats/redis in their containers; the folder keeps others out
    for svc in COMPOSE_SERVICES:
        env = auth.service_env(sec, svc, nats_url, redis_url)
        if svc == "gateway":
            env[ADMIN_KEY_ENV] = admin
        env["POLYSERVE_PREFIX"] = prefix
        auth.write_private(out / f"{svc}.env", "".join(f"{k}={v}\n" for k, v in env.items()))
    operator = {"POLYSERVE_NATS_URL": auth.with_userinfo(nats_url, auth.OPERATOR, sec.nats[auth.OPERATOR]),
                "POLYSERVE_REDIS_URL": auth.with_userinfo(redis_url, auth.OPERATOR, sec.redis[auth.OPERATOR])}
    auth.write_private(out / "operator.env", "".join(f"{k}={v}\n" for k, v in operator.items()))
    return sec


# ---------------------------------------------------------------- Kubernetes (issue 14)
K8S_NATS_SECRET = "polyserve-nats"  # a key per service user (its password) and auth.conf (nats-server's users)
K8S_AUTH_FILE = "auth.conf"  # mounted at /etc/nats-auth/ and included by infra/k8s/nats.yaml
K8S_USERS = (*auth.SERVICES, auth.OPERATOR)
K8S_REDIS = "_k8s"  # the one Redis password of infra/k8s (hex: it also goes on redis-server's command line)


def k8s_secrets(sec: auth.Secrets, admin_key: str, prefix: str = "polyserve", namespace: str = "polyserve") -> str:
    """The Secrets infra/k8s reads, as one manifest (stringData; `kubectl apply -f`):

    * `polyserve-nats`: one key per service (`gateway`, ..., `worker`, and `cli` for operators)
      holding that user's password, each Deployment reading only its own key, and `auth.conf`,
      the nats-server users with the per-service permissions `polyserve up` gives
      (shared/auth.nats_config), which the NATS StatefulSet mounts and includes;
    * `polyserve-redis`: the Redis password (one `requirepass` user in k8s; redis.yaml);
    * `polyserve-admin`: the gateway's admin API key."""
    import yaml

    users = "".join(auth.nats_config(sec, prefix).splitlines(keepends=True)[1:])  # without the `polyserve up` line
    nats = {u: sec.nats[u] for u in K8S_USERS}
    nats[K8S_AUTH_FILE] = f"# generated by `polyserve credentials k8s` (prefix {prefix})\n{users}"
    docs = [(K8S_NATS_SECRET, nats), ("polyserve-redis", {"password": sec.redis[K8S_REDIS]}),
            ("polyserve-admin", {"api-key": admin_key})]
    head = ("# generated by `polyserve credentials k8s`: real passwords. Never commit; apply with\n"
            "#   kubectl apply -f THIS-FILE   (then `kubectl -n polyserve rollout restart` NATS and the services)\n")
    class Dumper(yaml.SafeDumper):  # auth.conf as a readable `|` block, not one escaped line
        pass

    Dumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v,
                                                                style="|" if "\n" in v else None))
    return head + yaml.dump_all(
        [{"apiVersion": "v1", "kind": "Secret",
          "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "polyserve"}},
          "type": "Opaque", "stringData": data} for name, data in docs], Dumper=Dumper, sort_keys=False)



def _secrets_dir(out: Path | str, rotate: bool) -> tuple[Path, auth.Secrets]:
    """`out` made owner-only (0700), and the credentials kept there (new ones with `rotate`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    sec = None if rotate else auth.Secrets.load(out / "credentials.json")
    return out, sec if sec is not None else auth.Secrets.generate()

def write_k8s_secrets(out: Path, prefix: str = "polyserve", namespace: str = "polyserve",
                      rotate: bool = False) -> Path:
    """`out`/k8s-secrets.yaml (0600) from the credentials in `out` (made, or new with `rotate`)."""
    out, sec = _secrets_dir(out, rotate)
    if K8S_REDIS not in sec.redis:
        sec.redis[K8S_REDIS] = secrets.token_hex(24)
    sec.save(out / "credentials.json")
    admin = auth.load_or_create_admin_key(out / "admin.key", secrets.token_hex(32) if rotate else None)
    path = out / "k8s-secrets.yaml"
    auth.write_private(path, k8s_secrets(sec, admin, prefix, namespace))
    return path


def main(argv: list[str] | None = None) -> int:
    """`polyserve credentials compose|k8s [--dir secrets] ...`: write a stack's credentials."""
    import argparse

    p = argparse.ArgumentParser(prog="polyserve credentials",
                                description=f"{write_compose_secrets.__doc__}\n\nk8s:{k8s_secrets.__doc__}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=["compose", "k8s"], help="compose: files for compose.yaml (env files, server "
                   "configs); k8s: a Secret manifest for infra/k8s (DIR/k8s-secrets.yaml)")
    p.add_argument("--dir", default="secrets", help="where to write them (default ./secrets; compose.yaml reads "
                   "$POLYSERVE_SECRETS_DIR, default ./secrets)")
    p.add_argument("--prefix", default="polyserve")
    p.add_argument("--namespace", default="polyserve", help="k8s: the namespace of the Secrets")
    p.add_argument("--nats-url", default="nats://nats:4222", help="compose: NATS as the services reach it")
    p.add_argument("--redis-url", default="redis://redis:6379/0", help="compose: Redis as the services reach it")
    p.add_argument("--rotate", action="store_true", help="new passwords and admin key (restart the whole stack after)")
    args = p.parse_args(argv)
    if args.target == "k8s":
        path = write_k8s_secrets(Path(args.dir), args.prefix, args.namespace, args.rotate).resolve()
        print(f"wrote the Kubernetes Secrets to {path} (owner-only); apply with: kubectl apply -f {path}")
        return 0
    write_compose_secrets(Path(args.dir), args.prefix, args.nats_url, args.redis_url, args.rotate)
    print(f"wrote the compose credentials to {Path(args.dir).resolve()} (owner-only); admin key in "
          f"{Path(args.dir).resolve() / 'admin.key'}")
    return 0
