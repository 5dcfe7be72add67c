"""The chaos suite's cluster, faults and event observer (`polyserve bench chaos`, tests/chaos).

The cluster is what `polyserve up` starts (the same launcher code, supervisor included): sim
engine, several workers. Faults are real signals to those processes. The observer subscribes
to the request events, as any operator tool can, to count what the gateway accepted and what
ended with a terminal event (`completed` / `failed`); the terminal events it takes afterwards
from the JetStream stream that keeps them (nothing missed while it reconnected; `Observer`).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.js.errors
import redis
from nats.js import api

from polyserve.cli import launcher
from polyserve.proto import Keys
from polyserve.shared import auth, batching, durable, infra

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
STREAM_READER = "dispatcher"  # the user the event stream is read as (`Observer._reader`)
READ_WAIT_S = 20.0  # how long `Observer.finish` waits for the stream to hold every accepted request's end


async def _quiet(exc) -> None:  # disconnects are the point of the exercise
    pass


@dataclass
class Observer:
    """Request events by request id: admitted, the workers it was dispatched to, and its
    terminal events; `last_seen` the last event of each heard live (kind, seconds since `start`)
    and `away` when the live connection was down, for a failure's message. `source` says where
    the terminal events were read from.

    The live subscription is core NATS, at most once: what is published while the observer's own
    connection is still reconnecting after a nats-server restart never reaches it, and the
    gateway, reconnected first, sends its buffered events at once (a CI run missed the 25
    `completed` of one 50 ms batch so; the stream had them). And an event the gateway's outbox
    re-sends (its PubAck lost) reaches it twice. So `finish` takes the terminal events from the
    JetStream stream that keeps them (deduplicated by message id, docs/reliability.md); the live
    copy stands only where no stream can be read, and `source` says why."""

    state: launcher.ClusterState
    admitted: set[str] = field(default_factory=set)
    workers: dict[str, list[str]] = field(default_factory=dict)  # every worker it was dispatched to
    terminal: dict[str, list[str]] = field(default_factory=dict)
    last_seen: dict[str, tuple[str, float]] = field(default_factory=dict)
    away: list[list[float]] = field(default_factory=list)  # [disconnected, reconnected] (s since start)
    source: str = "core NATS subscription"
    _nc: object = None
    _t0: float = field(default_factory=time.monotonic)

    @property
    def subject(self) -> str:
        return f"{self.state.prefix}.v1.events.request.>"

    def servers(self) -> list[str]:
        return [u.strip() for u in current(self.state).nats_url.split(",") if u.strip()]

    def elapsed(self) -> float:
        """Seconds since `start`, to 3 decimals."""
        return round(time.monotonic() - self._t0, 3)

    def take(self, data: bytes, live: bool = True) -> None:
        for ev in batching.event_dicts(data):  # one event or several (shared/batching.py)
            rid, kind = ev.get("request_id", ""), ev.get("event")
            if live:
                self.last_seen[rid] = (kind, self.elapsed())
            if kind == "admitted":
                self.admitted.add(rid)
            elif kind == "dispatched":
                self.workers.setdefault(rid, []).append(ev.get("worker_id", ""))
            elif kind in ("completed", "failed"):
                self.terminal.setdefault(rid, []).append(kind)

    async def start(self) -> None:
        async def on(msg) -> None:
            self.take(msg.data)

        async def down() -> None:
            if not self._nc.is_closed:  # not `finish` draining it
                self.away.append([self.elapsed()])

        async def back() -> None:
            if self.away and len(self.away[-1]) == 1:
                self.away[-1].append(self.elapsed())

        self._t0 = time.monotonic()
        self._nc = await nats.connect(servers=self.servers(), name="chaos-observer", max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.2, error_cb=_quiet, disconnected_cb=down,
                                      reconnected_cb=back, inbox_prefix=auth.inbox_prefix(auth.OPERATOR).encode())
        await self._nc.subscribe(self.subject, cb=on)
        await self._nc.flush()

    async def finish(self, expected: set[str] = frozenset(), wait_s: float = READ_WAIT_S) -> None:
        """Stop listening; take the terminal events from the JetStream stream: all it holds, and
        (up to `wait_s`: a NATS cluster electing its leaders, the gateway's outbox re-sending every
        2 s) until it holds one of every `expected` request. Where no stream can be read (JetStream
        off), the live copy stands and `source` says why."""
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()
        live, self.terminal = self.terminal, {}
        try:
            self.source = await self._read_stream(set(expected), wait_s)
        except Exception as exc:  # noqa: BLE001 - the row says it; the scenario's other figures stand
            self.terminal = live
            self.source = f"core NATS subscription (the JetStream stream was not read: {type(exc).__name__} {exc})"

    async def close(self) -> None:
        """Disconnect (after `finish`, or when the scenario failed before it)."""
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()

    def _reader(self) -> tuple[list[str], str]:
        """Servers, with the credentials, and the inbox prefix to read the event stream with. The
        operator (`cli`) may publish nothing, so it makes no JetStream API request (docs/security.md):
        under `polyserve up`'s credentials the stream is read as a service that consumes it
        (`STREAM_READER`, as tests/system do)."""
        sec = auth.Secrets.load(Path(self.state.run_dir) / "secrets" / "credentials.json")
        if sec is None:  # a cluster without credentials
            return self.servers(), "_INBOX"
        return ([auth.with_userinfo(u, STREAM_READER, sec.nats[STREAM_READER]) for u in self.servers()],
                auth.inbox_prefix(STREAM_READER))

    async def _read_stream(self, expected: set[str], wait_s: float) -> str:
        """Read the whole event stream into `terminal` (class docstring); where it was read from."""
        servers, inbox = self._reader()
        nc = await nats.connect(servers=servers, name="chaos-observer-stream", max_reconnect_attempts=-1,
                                reconnect_time_wait=0.2, error_cb=_quiet, inbox_prefix=inbox.encode())
        try:
            reader = _StreamReader(nc, durable.stream_name(self.state.prefix), lambda d: self.take(d, live=False))
            done = await reader.run(lambda: expected <= self.terminal.keys(), time.monotonic() + wait_s)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        if done:
            return f"JetStream stream {reader.stream}"
        return (f"JetStream stream {reader.stream} (incomplete after {wait_s:g}s: {len(reader.seqs)} messages "
                f"read of sequences {reader.first}-{reader.last}, {reader.consumers} consumer(s))")


class _StreamReader:
    """Every message of a JetStream stream, each once (by stream sequence), to `take`, through a
    push consumer from the first message on; until every sequence up to the stream's last (asked
    again every 0.5 s: a NATS cluster that lost a node may answer for a while without its
    leader, with an empty state) was read and `enough()`: what the caller waits for. A consumer
    that delivers nothing for STALL_S while that is not so (one made while the cluster elected
    its leaders) is replaced by one from the first sequence not read."""

    STALL_S = 3.0

    def __init__(self, nc, stream: str, take: Callable[[bytes], None]):
        self.nc, self.stream, self.take = nc, stream, take
        self.jsm = nc.jsm(timeout=durable.API_TIMEOUT_S)
        self.seqs: set[int] = set()
        self.first = 1
        self.read = self.last = self.consumers = 0  # read: the highest sequence read
        self._progress = time.monotonic()

    async def _on(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq not in self.seqs:
            self.seqs.add(seq)
            self.read = max(self.read, seq)
            self._progress = time.monotonic()
            self.take(msg.data)

    def missing(self) -> int:
        """The first sequence up to the last not read yet; 0 when none."""
        return next((s for s in range(self.first, self.last + 1) if s not in self.seqs), 0)

    async def _consumer(self, deliver: str) -> str:
        name = f"chaos-observer-{os.getpid()}-{self.consumers}-{time.monotonic_ns() % 10**9}"
        await self.jsm.add_consumer(self.stream, api.ConsumerConfig(
            name=name, deliver_subject=deliver, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.missing() or self.read + 1, ack_policy=api.AckPolicy.NONE, inactive_threshold=60.0))
        self.consumers += 1
        self._progress = time.monotonic()
        return name

    async def run(self, enough: Callable[[], bool], deadline: float) -> bool:
        """Read until every sequence and `enough()`, or `deadline`; whether both held. Raises what
        the JetStream API said when there is no stream (NotFoundError) or it never answered."""
        deliver = self.nc.new_inbox()
        await self.nc.subscribe(deliver, cb=self._on)
        consumer, answered, polled = "", False, 0.0
        while True:
            if time.monotonic() - polled >= 0.5:
                polled = time.monotonic()
                try:
                    info = (await self.jsm.stream_info(self.stream)).state
                    self.first, self.last = max(self.first, info.first_seq), max(self.last, info.last_seq)
                    answered = True
                    stalled = time.monotonic() - self._progress > self.STALL_S
                    if not consumer or stalled and (self.missing() or not enough()):
                        if consumer:
                            with contextlib.suppress(Exception):
                                await self.jsm.delete_consumer(self.stream, consumer)
                        consumer = await self._consumer(deliver)
                except nats.js.errors.NotFoundError:
                    raise
                except (nats.errors.TimeoutError, nats.js.errors.APIError):  # no leader yet (503, timeouts)
                    if time.monotonic() > deadline and not answered:
                        raise
            if answered and not self.missing() and enough() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        if consumer:
            with contextlib.suppress(Exception):  # else it goes after inactive_threshold
                await self.jsm.delete_consumer(self.stream, consumer)
        return answered and not self.missing() and enough()


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
