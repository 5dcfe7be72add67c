"""`python -m polyserve.cli.supervisor RUN_DIR`: keeps what `polyserve up` started alive.

`up` starts nats-server, redis-server and the services, waits until they are ready and
then starts this process with the services' environment. It watches every pid in
RUN_DIR/state.json (polling: the first generation are not its children) and restarts a
process that died, on the same ports and data directories (redis-server replays its
append-only file), after a backoff: 0.5 s, doubling to 30 s, back to 0.5 s once the
process had stayed up 60 s. Each restart is logged (logs/supervisor.log), counted in
state.json (`restarts`, shown by `polyserve status`) and in RUN_DIR/supervisor.prom
(Prometheus text format, for a node-exporter textfile collector). SIGTERM (`polyserve
down`) ends it after the restart under way; it never stops the processes itself.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from polyserve.cli import topology
from polyserve.cli.launcher import REPLICATED, ClusterState, module_of, spawn_service
from polyserve.shared import infra

logger = logging.getLogger("polyserve.supervisor")

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
RESET_AFTER_S = 60.0
POLL_S = 0.1


def backoff(delay: float, uptime: float) -> tuple[float, float]:
    """(the wait before this restart, the next one's) for a process that ran `uptime` s."""
    wait = INITIAL_BACKOFF_S if uptime >= RESET_AFTER_S else delay
    return wait, min(wait * 2, MAX_BACKOFF_S)


@dataclass
class Child:
    name: str
    pid: int
    started: float  # monotonic
    delay: float = INITIAL_BACKOFF_S
    restart_at: float | None = None


class Supervisor:
    """Restarts the processes of one run dir (module docstring)."""

    def __init__(self, run_dir: Path, env: dict[str, str] | None = None):
        self.run_dir = Path(run_dir)
        self.env = dict(os.environ if env is None else env)
        state = ClusterState.load(self.run_dir)
        if state is None:
            raise SystemExit(f"no state.json in {self.run_dir}: nothing to supervise")
        self.state = state
        state.pids["supervisor"] = os.getpid()  # `up` writes it too; whichever save comes last has it
        now = time.monotonic()
        self.children = {n: Child(n, p, now) for n, p in state.pids.items() if n != "supervisor"}
        self.stopping = False

    def start(self, name: str) -> int:
        """Start `name` again as `up` did; its pid."""
        st = self.state
        proc = topology.restart(name, st)  # a NATS cluster node, a Redis replica or Sentinel
        if proc is not None:
            return proc.pid
        if name == "nats-server":
            port = urlparse(st.nats_url).port
            proc, _, _ = infra.start_nats(self.run_dir / "nats", port=port, monitor_port=st.nats_monitor_port,
                                          config=st.nats_config or None)
        elif name == "redis-server":
            proc, _ = infra.start_redis(self.run_dir / "redis", port=urlparse(st.redis_url).port,
                                        config=st.redis_config or None)
        else:  # with its own credentials and the same configuration files, as `up` did
            module = module_of(name)  # "gpu-agent" -> "gpu_agent", "gateway-2" -> "gateway"
            proc = spawn_service(module, self.env, self.run_dir, name if module in REPLICATED else "")
        return proc.pid

    def step(self) -> None:
        """One look at every process: note deaths, carry out restarts that are due."""
        now = time.monotonic()
        for child in self.children.values():
            if self.stopping:
                return
            if child.restart_at is None:
                if infra.pid_alive(child.pid):
                    continue
                wait, child.delay = backoff(child.delay, now - child.started)
                child.restart_at = now + wait
                logger.warning("%s (pid %d) died%s; restarting in %.1fs", child.name, child.pid,
                               f" after {now - child.started:.1f}s" if child.name in self.state.restarts else "",
                               wait)
            elif now >= child.restart_at:
                self._restart(child)

    def _restart(self, child: Child) -> None:
        try:
            pid = self.start(child.name)
        except Exception as exc:  # noqa: BLE001 - e.g. a port still taken: try again after the backoff
            wait, child.delay = backoff(child.delay, 0.0)
            child.restart_at = time.monotonic() + wait
            logger.error("could not restart %s: %s; next try in %.1fs", child.name, exc, wait)
            return
        child.pid, child.started, child.restart_at = pid, time.monotonic(), None
        st = self.state
        st.pids[child.name] = pid
        st.restarts[child.name] = st.restarts.get(child.name, 0) + 1
        st.save()
        self._write_metrics()
        logger.warning("restarted %s: pid %d (restart #%d)", child.name, pid, st.restarts[child.name])

    def _write_metrics(self) -> None:
        lines = ["# HELP polyserve_process_restarts_total Processes restarted by the polyserve supervisor.",
                 "# TYPE polyserve_process_restarts_total counter"]
        lines += [f'polyserve_process_restarts_total{{process="{n}"}} {c}' for n, c in sorted(self.state.restarts.items())]
        path = self.run_dir / "supervisor.prom"
        path.with_suffix(".tmp").write_text("\n".join(lines) + "\n")
        os.replace(path.with_suffix(".tmp"), path)

    def run(self) -> int:
        def stop(signum, _frame) -> None:
            logger.info("signal %d: no more restarts", signum)
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        logger.info("supervising %s (pid %d)", ", ".join(self.children), os.getpid())
        self._write_metrics()
        while not self.stopping:
            if not (self.run_dir / "state.json").exists():
                logger.info("state.json is gone (polyserve down): exiting")
                break
            self.step()
            time.sleep(POLL_S)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m polyserve.cli.supervisor RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
