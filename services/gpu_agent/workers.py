"""The worker processes of one gpu-agent: start, stop, watch (no bus, no Redis).

`WorkerPool` owns the processes and their reported load; the agent's service tells the
cluster (WorkerDown, AgentInfo) about what `reap` returns.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from polyserve.gpu_agent import policy
from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.proto import StartWorker

logger = logging.getLogger(__name__)


@dataclass
class WorkerProc:
    """A worker process this agent started."""

    worker_id: str
    deployment: str
    model: str
    engine: str
    proc: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.time)
    stopping: bool = False
    kill_at: float | None = None  # monotonic deadline for SIGKILL once stopping
    killed: bool = False

    def view(self) -> policy.WorkerView:
        return policy.WorkerView(self.worker_id, self.deployment, self.started_at, self.stopping)


class WorkerPool:
    """The worker processes this agent started, and the load their heartbeats report."""

    def __init__(self, settings: GpuAgentSettings):
        self.settings = settings
        self.workers: dict[str, WorkerProc] = {}
        self.load: dict[str, int] = {}  # worker_id -> running + waiting, from heartbeats
        self.log_dir = Path(settings.worker_log_dir) if settings.worker_log_dir else None

    def open_log_dir(self, gpu_id: str) -> Path:
        """The folder of the workers' logs (a fresh temporary one unless configured)."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"polyserve-{gpu_id}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir

    def active(self) -> list[WorkerProc]:
        """Workers not being stopped."""
        return [w for w in self.workers.values() if not w.stopping]

    def record_load(self, worker_id: str, running: int, waiting: int) -> None:
        """A heartbeat's load, kept for this pool's own workers only."""
        if worker_id in self.workers:
            self.load[worker_id] = max(0, running) + max(0, waiting)

    def spawn(self, req: StartWorker, gpu_id: str, cuda_device: str) -> str:
        """Start one worker process for `req` (its `extra_env` checked by the caller) with the
        operator's fixed worker command; returns its id. Raises OSError if it cannot."""
        s = self.settings
        worker_id = f"w-{uuid.uuid4().hex[:10]}"
        cmd = policy.worker_command(s.worker_cmd, s.worker_module, sys.executable)
        env = policy.worker_env(os.environ, nats_url=s.worker_nats_url or s.nats_url,
                                redis_url=s.worker_redis_url or s.redis_url, prefix=s.prefix,
                                worker_id=worker_id, deployment=req.deployment, model=req.model,
                                engine=req.engine, gpu_id=gpu_id, time_scale=s.worker_time_scale,
                                cuda_device=cuda_device, extra=req.extra_env)
        log_path = self.open_log_dir(gpu_id) / f"{worker_id}.log"
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self.workers[worker_id] = WorkerProc(worker_id, req.deployment, req.model, req.engine, proc, log_path)
        logger.info("started worker %s (pid %d) for %s/%s engine=%s; log %s",
                    worker_id, proc.pid, req.deployment, req.model, req.engine, log_path)
        return worker_id

    def stop(self, worker_ids: list[str], timeout: float) -> list[str]:
        """SIGTERM the named workers; the watcher SIGKILLs them after `timeout`."""
        stopped = []
        for wid in worker_ids:
            w = self.workers.get(wid)
            if w is None or w.stopping:
                continue
            w.stopping = True
            w.kill_at = time.monotonic() + timeout
            try:
                os.kill(w.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # already gone; the watcher reaps it
            stopped.append(wid)
            logger.info("stopping worker %s (pid %d), SIGKILL after %.1fs", wid, w.proc.pid, timeout)
        return stopped

    def reap(self) -> list[tuple[WorkerProc, str, bool]]:
        """Collect exited workers; SIGKILL stopping ones past their deadline. Returns each
        worker gone with the reason and whether it exited on its own (not stopped by us)."""
        gone = []
        now = time.monotonic()
        for w in list(self.workers.values()):
            if not _exited(w.proc):
                if w.stopping and w.kill_at is not None and now >= w.kill_at and not w.killed:
                    logger.warning("worker %s ignored SIGTERM for its drain timeout; SIGKILL", w.worker_id)
                    _kill_group(w.proc.pid)
                    w.killed = True
                continue
            _kill_group(w.proc.pid)  # orphans of the worker; the zombie keeps the group id ours
            rc = w.proc.wait()
            if self.workers.pop(w.worker_id, None) is None:
                continue  # a concurrent reap (watcher and drain) already reported it
            self.load.pop(w.worker_id, None)
            if w.stopping:
                how = "killed by gpu-agent after its drain timeout" if w.killed else "stopped by gpu-agent"
                reason = f"{how} ({policy.exit_reason(rc)})"
                logger.info("worker %s %s", w.worker_id, reason)
            else:
                reason = policy.exit_reason(rc)
                logger.warning("worker %s (%s) exited on its own: %s; log %s",
                               w.worker_id, w.deployment, reason, w.log_path)
            gone.append((w, reason, not w.stopping))
        return gone


def _exited(proc: subprocess.Popen) -> bool:
    """True when the process has exited, without reaping it (so its pid stays ours)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return proc.poll() is not None
    except AttributeError:  # no waitid on this platform
        return proc.poll() is not None


def _kill_group(pid: int) -> None:
    """SIGKILL the session/process group a worker leads (start_new_session=True)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
