"""Pure decisions of the gpu-agent: ids, worker commands and environments, whom to stop.

No I/O here (DESIGN.md, rule 1): the service passes in what it observed.
"""
from __future__ import annotations

import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerView:
    """What the stop policy needs to know about one running worker."""

    worker_id: str
    deployment: str
    started_at: float
    stopping: bool = False


def resolve_gpu_id(configured: str, index: int, simulated: bool) -> str:
    """The configured id, else "gpu<N>" for an NVML device N, else "sim<N>"."""
    if configured:
        return configured
    return f"sim{index}" if simulated else f"gpu{index}"


def worker_command(worker_cmd: str, worker_module: str, python: str) -> list[str]:
    """`worker_cmd` shlex-split when set, else `python -m worker_module`."""
    if worker_cmd.strip():
        return shlex.split(worker_cmd)
    return [python, "-m", worker_module]


WORKER_SETTING = "POLYSERVE_WORKER_"
# Worker settings the agent owns (identity, connections, trace export): never from a message.
CONNECTIONS = frozenset(WORKER_SETTING + n for n in ("NATS_URL", "REDIS_URL", "PREFIX"))
AGENT_OWNED = CONNECTIONS | frozenset(WORKER_SETTING + n for n in (
    "WORKER_ID", "DEPLOYMENT", "MODEL", "ENGINE", "GPU_ID", "INSTANCE", "OTLP_ENDPOINT"))
MAX_EXTRA_ENV = 64
MAX_ENV_VALUE = 4096


def check_extra_env(extra: Mapping[str, str], allowed: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Why each refused key of a StartWorker's `extra_env` is refused: [(key, reason)].

    Allowed: `POLYSERVE_WORKER_<SETTING>` (a worker setting; not one the agent owns) and
    the operator's `allowed` names. Anything else (PYTHONWARNINGS, BROWSER, LD_PRELOAD,
    PATH, ...) could run code in the worker, so a message may not set it."""
    refused = []
    if len(extra) > MAX_EXTRA_ENV:
        return [("extra_env", f"{len(extra)} variables; at most {MAX_EXTRA_ENV}")]
    for key, value in extra.items():
        if key in AGENT_OWNED:
            refused.append((key, "set by the gpu-agent itself"))
        elif key not in allowed and not (key.startswith(WORKER_SETTING) and len(key) > len(WORKER_SETTING)
                                         and key.replace("_", "").isalnum() and key.isupper()):
            refused.append((key, "not a POLYSERVE_WORKER_* setting nor in the agent's worker_env_allow"))
        elif "\0" in value or len(value) > MAX_ENV_VALUE:
            refused.append((key, f"value has a NUL byte or more than {MAX_ENV_VALUE} characters"))
    return refused


def worker_env(base: Mapping[str, str], *, nats_url: str, redis_url: str, prefix: str,
               worker_id: str, deployment: str, model: str, engine: str, gpu_id: str,
               time_scale: str = "", cuda_device: str = "",
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one worker process.

    The agent's connection settings win over anything inherited; `extra`
    (StartWorker.extra_env, already checked by `check_extra_env`) is applied after
    the defaults but cannot change the worker's identity or connections, so a plan
    cannot start a worker that the agent would then mis-account. The agent's own
    settings (`POLYSERVE_GPU_AGENT_*`, its credentials among them) and any
    service-scoped worker connection are not passed on.
    """
    env = {k: v for k, v in base.items() if not k.startswith("POLYSERVE_GPU_AGENT_") and k not in CONNECTIONS}
    if time_scale:
        env["POLYSERVE_WORKER_TIME_SCALE"] = time_scale
    if cuda_device:
        env["CUDA_VISIBLE_DEVICES"] = cuda_device
    env.update(extra or {})
    env.update({
        "POLYSERVE_NATS_URL": nats_url,
        "POLYSERVE_REDIS_URL": redis_url,
        "POLYSERVE_PREFIX": prefix,
        "POLYSERVE_WORKER_WORKER_ID": worker_id,
        "POLYSERVE_WORKER_DEPLOYMENT": deployment,
        "POLYSERVE_WORKER_MODEL": model,
        "POLYSERVE_WORKER_ENGINE": engine,
        "POLYSERVE_WORKER_GPU_ID": gpu_id,
    })
    return env


def choose_victims(workers: Sequence[WorkerView], deployment: str, count: int,
                   load: Mapping[str, int] | None = None, worker_id: str | None = None) -> list[str]:
    """Which workers to stop for a StopWorker request.

    A named `worker_id` is stopped if it runs here (whatever `deployment` says
    is ignored only when it is empty). Otherwise `count` workers of
    `deployment` that are not already stopping, least busy first (requests
    running + waiting from their last heartbeat; a worker with no heartbeat yet
    counts 0, it serves nobody), ties broken by the most recently started.
    """
    live = [w for w in workers if not w.stopping]
    if worker_id is not None:
        return [w.worker_id for w in live
                if w.worker_id == worker_id and (not deployment or w.deployment == deployment)]
    load = load or {}
    mine = [w for w in live if w.deployment == deployment]
    mine.sort(key=lambda w: (load.get(w.worker_id, 0), -w.started_at))
    return [w.worker_id for w in mine[:max(0, count)]]


def exit_reason(rc: int) -> str:
    """`worker process exited with code <rc>`, naming the signal when one killed it."""
    reason = f"worker process exited with code {rc}"
    if rc < 0:
        try:
            reason += f" ({signal.Signals(-rc).name})"
        except ValueError:
            pass
    return reason
