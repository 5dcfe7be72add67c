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


def worker_env(base: Mapping[str, str], *, nats_url: str, redis_url: str, prefix: str,
               worker_id: str, deployment: str, model: str, engine: str, gpu_id: str,
               time_scale: str = "", cuda_device: str = "",
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one worker process.

    The agent's connection settings win over anything inherited; `extra`
    (StartWorker.extra_env) is applied after the defaults but cannot change the
    worker's identity or connections, so a plan cannot start a worker that the
    agent would then mis-account.
    """
    env = dict(base)
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
