"""`polyserve health [SERVICE]`: the container healthcheck of infra/Dockerfile and compose.yaml.

SERVICE defaults to the one this container runs (PID 1's `python -m polyserve.<module>`).
The gateway is healthy when its `GET /readyz` answers 200 (it serves: NATS and Redis
reachable, not draining). The other services serve no HTTP; one is healthy when Redis holds
a live registration of that service (each service refreshes its entry every few seconds,
with a TTL, while it runs: `StateStore.put_service`). The check is per service name, so it
tells one container from another only when each service runs once (as in compose.yaml).
Settings (ports, Redis URL, prefix) come from the same environment as the service's own.
"""
from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from polyserve.shared.auth import redact
from polyserve.shared.state import connect_sync

SERVICES = {"gateway": "gateway", "predictor": "predictor", "dispatcher": "dispatcher", "planner": "planner",
            "gpu_agent": "gpu-agent", "worker": "worker"}


def service_of_cmdline(argv: list[str]) -> str | None:
    """The service a command line runs (`python -m polyserve.gpu_agent` -> gpu-agent), or None."""
    for i, arg in enumerate(argv):
        mod = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else (arg[2:] if arg.startswith("-mpolyserve.") else "")
        if mod.startswith("polyserve."):
            return SERVICES.get(mod.split(".")[1])
    return None


def pid1_service() -> str | None:
    try:
        raw = Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return None
    return service_of_cmdline([a.decode(errors="replace") for a in raw.split(b"\0") if a])


def check(service: str, environ: dict[str, str] | None = None, timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, why) for `service`, with settings from `environ` (default os.environ)."""
    from polyserve.shared import settings as settings_mod

    environ = dict(os.environ if environ is None else environ)
    if service == "gateway":
        from polyserve.gateway.config import GatewaySettings

        s = settings_mod.load(GatewaySettings, "gateway", environ=environ)
        host = "127.0.0.1" if s.host in ("", "0.0.0.0", "::") else s.host
        url = f"http://{host}:{s.port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return resp.status == 200, f"{url}: {resp.status}"
        except urllib.error.HTTPError as exc:
            return False, f"{url}: {exc.code} {exc.read()[:200].decode(errors='replace')}"
        except OSError as exc:
            return False, f"{url}: {exc}"
    if service not in SERVICES.values():
        return False, f"unknown service {service!r}; one of {sorted(SERVICES.values())}"
    import redis

    from polyserve.proto import Keys

    s = settings_mod.load(settings_mod.CommonSettings, service, environ=environ)
    keys = Keys(s.prefix)
    key = keys.workers if service == "worker" else keys.services
    try:
        r = connect_sync(s.redis_url, timeout)  # redis:// or redis+sentinel://
        members = [m.decode() for m in r.zrangebyscore(key, time.time(), "+inf")]
    except redis.RedisError as exc:
        return False, f"Redis at {redact(s.redis_url)} unreachable: {exc}"
    live = members if service == "worker" else [m for m in members if m.split(":", 1)[0] == service]
    if live:
        return True, f"{service} registered live in Redis: {', '.join(sorted(live))}"
    return False, f"no live {service} registered in Redis ({redact(s.redis_url)}, prefix {s.prefix})"


def main(service: str | None) -> int:
    service = service or pid1_service()
    if not service:
        print("polyserve health: name the service (this container's PID 1 is not `python -m polyserve.<svc>`)")
        return 2
    ok, why = check(service)
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1
