"""The chaos suite's cluster, faults and event observer (`polyserve bench chaos`, tests/chaos).

The cluster is what `polyserve up` starts (the same launcher code, supervisor included): sim
engine, several workers. Faults are real signals to those processes. The observer subscribes
to the request events, as any operator tool can, to count what the gateway accepted and what
ended with a terminal event (`completed` / `failed`); where a JetStream stream keeps the
request events, it reads them from there afterwards (nothing missed while it reconnected).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import redis

from polyserve.cli import launcher
from polyserve.proto import Keys
from polyserve.shared import auth, batching, infra

MODEL = "chaos-sim"


@dataclass
class ChaosConfig:
    workers: int = 3
    requests: int = 300
    concurrency: int = 100
    tokens: int = 64
    time_scale: float = 0.5  # sim compute x this: 64 tokens take about 1.5 s on one worker
    hang_s: float = 30.0  # a stream with nothing terminal by then is hung
    fault_after: float = 0.3  # the fault hits once this share of the requests has started
    budget_s: float = 10.0  # admitted requests under overload must finish within this
    overload_factor: float = 40.0
    overload_inflight: int = 32  # the gateway's max_inflight in the overload scenario
    overload_s: float = 5.0
    slow_readers: int = 4
    slow_tokens: int = 20_000
    slow_stall_s: float = 12.0
    extra_env: dict[str, str] = field(default_factory=dict)


def cluster_flag(name: str) -> bool:
    """Whether `polyserve up` (launcher.ClusterSpec) has this field: features that other work adds."""
    return any(f.name == name for f in dataclasses.fields(launcher.ClusterSpec))


def spec_for(cfg: ChaosConfig, env: dict[str, str] | None = None, **fields) -> launcher.ClusterSpec:
    base = {"POLYSERVE_WORKER_TIME_SCALE": str(cfg.time_scale), "POLYSERVE_LOG_LEVEL": "WARNING",
            "POLYSERVE_GATEWAY_MAX_TOKENS_LIMIT": str(max(4096, cfg.slow_tokens)),
            "POLYSERVE_PREDICTOR_PROXY_ARTIFACT": ""}  # the historical mean: no model to load
    base.update(cfg.extra_env)
    base.update(env or {})
    return launcher.ClusterSpec(run_dir=Path(tempfile.mkdtemp(prefix="ps-chaos-")) / "run", engine="sim",
                                model=MODEL, port=infra.free_port(), nats_port=0, redis_port=0,
                                min_replicas=cfg.workers, max_replicas=cfg.workers, extra_env=base,
                                ready_timeout_s=90, **fields)


def start(spec: launcher.ClusterSpec, workers: int, timeout: float = 60.0) -> launcher.ClusterState:
    """`polyserve up` with `spec`, then until `workers` workers are registered."""
    state = launcher.up(spec, progress=lambda m: None)
    try:
        wait_workers(state, workers, timeout)
    except BaseException:
        stop(spec)
        raise
    return state


def stop(spec: launcher.ClusterSpec) -> None:
    """`polyserve down`; if that fails, SIGKILL every pid of state.json (supervisor first) and
    the gpu-agent's workers, so nothing this harness started outlives it."""
    try:
        launcher.down(spec.run_dir, progress=lambda m: None)
    except Exception:  # noqa: BLE001 - e.g. a launcher being changed under us: clean up by hand
        _force_stop(spec.run_dir)
        raise
    finally:
        shutil.rmtree(spec.run_dir.parent, ignore_errors=True)


def _force_stop(run_dir: Path) -> None:
    try:
        pids: dict[str, int] = json.loads((run_dir / "state.json").read_text())["pids"]
    except (OSError, ValueError, KeyError):
        return
    agent = pids.get("gpu-agent")
    workers = [pid for _, pid in _children(agent)] if agent else []
    for pid in [pids.pop("supervisor", 0), *pids.values(), *workers]:
        with contextlib.suppress(OSError):
            if pid:
                os.kill(pid, signal.SIGKILL)
                infra.pid_alive(pid)


def _children(ppid: int):
    """(/proc dir, pid) of the processes whose parent is `ppid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                yield stat.parent, int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue


def current(state: launcher.ClusterState) -> launcher.ClusterState:
    """state.json as it is now (the supervisor rewrites the pids it restarts)."""
    return launcher.ClusterState.load(Path(state.run_dir)) or state


def _redis(url: str):
    """A blocking Redis client for any URL `polyserve up` writes (a Sentinel URL with --redis-replica)."""
    try:
        from polyserve.shared.state import connect_sync
    except ImportError:  # a tree without Sentinel support
        return redis.Redis.from_url(url, socket_timeout=2)
    return connect_sync(url)


def live_workers(state: launcher.ClusterState) -> int:
    r = _redis(current(state).redis_url)
    try:
        return r.zcount(Keys(state.prefix).workers, time.time(), "+inf")
    finally:
        r.close()


def wait_workers(state: launcher.ClusterState, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while live_workers(state) < n:
        if time.monotonic() > deadline:
            raise launcher.LaunchError(f"{n} workers not registered within {timeout:.0f}s")
        time.sleep(0.2)


def worker_pids(state: launcher.ClusterState) -> dict[str, int]:
    """worker id -> pid of the gpu-agent's worker processes (Linux /proc)."""
    out: dict[str, int] = {}
    for proc, pid in _children(current(state).pids.get("gpu-agent", -1)):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        wid = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"POLYSERVE_WORKER_WORKER_ID=")), "")
        if wid:
            out[wid] = pid
    return out


def signal_process(state: launcher.ClusterState, name: str, sig: int) -> int:
    """Send `sig` to the process `name` of state.json; its pid."""
    pid = current(state).pids[name]
    os.kill(pid, sig)
    infra.pid_alive(pid)  # reaps it when it is this process's child (nats and redis are)
    return pid


def nats_nodes(state: launcher.ClusterState) -> list[str]:
    """The nats-server process names of state.json: "nats-server" first, then a cluster's other
    nodes ("nats-2", "nats-3", ...)."""
    return sorted((n for n in current(state).pids if n.startswith("nats")), key=lambda n: (n != "nats-server", n))


# ---------------------------------------------------------------------------- observer
@dataclass
class Observer:
    """Request events by request id: admitted, the workers it was dispatched to, and its
    terminal events. `source` says where they were read from."""

    state: launcher.ClusterState
    admitted: set[str] = field(default_factory=set)
    workers: dict[str, list[str]] = field(default_factory=dict)  # every worker it was dispatched to
    terminal: dict[str, list[str]] = field(default_factory=dict)
    source: str = "core NATS subscription"
    _nc: object = None

    @property
    def subject(self) -> str:
        return f"{self.state.prefix}.v1.events.request.>"

    def servers(self) -> list[str]:
        return [u.strip() for u in current(self.state).nats_url.split(",") if u.strip()]

    def take(self, data: bytes) -> None:
        for ev in batching.event_dicts(data):  # one event or several (shared/batching.py)
            rid, kind = ev.get("request_id", ""), ev.get("event")
            if kind == "admitted":
                self.admitted.add(rid)
            elif kind == "dispatched":
                self.workers.setdefault(rid, []).append(ev.get("worker_id", ""))
            elif kind in ("completed", "failed"):
                self.terminal.setdefault(rid, []).append(kind)

    async def start(self) -> None:
        async def on(msg) -> None:
            self.take(msg.data)

        async def quiet(exc) -> None:  # disconnects are the point of the exercise
            pass

        self._nc = await nats.connect(servers=self.servers(), name="chaos-observer", max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.2, error_cb=quiet,
                                      inbox_prefix=auth.inbox_prefix(auth.OPERATOR).encode())
        await self._nc.subscribe(self.subject, cb=on)
        await self._nc.flush()

    async def finish(self) -> None:
        """Stop; replace what was seen with the JetStream stream's copy when one keeps the events."""
        nc = self._nc
        try:
            stream = await asyncio.wait_for(nc.jetstream().find_stream_name_by_subject(
                f"{self.state.prefix}.v1.events.request.completed"), 5)
        except Exception:  # noqa: BLE001 - no stream (or no JetStream access): the live copy stands
            stream = None
        if stream:
            self.admitted, self.workers, self.terminal = set(), {}, {}
            self.source = f"JetStream stream {stream}"
            await self._replay(nc)
        with contextlib.suppress(Exception):
            await nc.drain()

    async def close(self) -> None:
        """Disconnect (after `finish`, or when the scenario failed before it)."""
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def _replay(self, nc) -> None:
        sub = await nc.jetstream().subscribe(self.subject, ordered_consumer=True)
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                msg = await sub.next_msg(timeout=1.0)
                self.take(msg.data)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


# ---------------------------------------------------------------------------- faults
async def kill_worker(ctx) -> dict:
    """SIGKILL the worker with the most requests dispatched to it."""
    pids = worker_pids(ctx.state)
    if not pids:
        return {"skipped": "no worker process found"}
    load = {w: sum(1 for ws in ctx.observer.workers.values() if ws[-1] == w) for w in pids}
    victim = max(pids, key=lambda w: load[w])
    os.kill(pids[victim], signal.SIGKILL)
    return {"worker": victim, "pid": pids[victim]}


async def pause_nats(ctx, seconds: float = 5.0) -> dict:
    """SIGSTOP nats-server, SIGCONT after `seconds` (a stall: no restart, no lost connections)."""
    pid = signal_process(ctx.state, nats_nodes(ctx.state)[0], signal.SIGSTOP)
    ctx.paused.append(pid)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
        ctx.paused.remove(pid)
    return {"pid": pid, "stopped_s": seconds}


def killer(name: str, sig: int = signal.SIGKILL):
    """A fault that sends `sig` to process `name` (the supervisor restarts it)."""

    async def fault(ctx) -> dict:
        return {"process": name, "pid": signal_process(ctx.state, name, sig), "signal": signal.Signals(sig).name}

    return fault


async def kill_nats(ctx) -> dict:
    """SIGKILL nats-server (the first node of a cluster); the supervisor starts it again on its port."""
    name = nats_nodes(ctx.state)[0]
    return {"process": name, "pid": signal_process(ctx.state, name, signal.SIGKILL), "signal": "SIGKILL"}


async def kill_nats_node(ctx) -> dict:
    """SIGKILL one node of the NATS cluster (the last, not "nats-server")."""
    nodes = nats_nodes(ctx.state)
    if len(nodes) < 3:
        return {"skipped": f"the cluster has {len(nodes)} nats-server node(s), not 3"}
    return {"process": nodes[-1], "pid": signal_process(ctx.state, nodes[-1], signal.SIGKILL)}


def resume_paused(ctx) -> None:
    """SIGCONT whatever a fault left stopped (the harness was interrupted)."""
    for pid in list(ctx.paused):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
